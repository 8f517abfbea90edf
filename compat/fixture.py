"""torchwire's stand-in for torch's ``TensorPipeRpcAgentTestFixture``, and the test classes.

torch's own test files (``test/distributed/rpc/test_tensorpipe_agent.py``) build each
runnable class as ``type(name, (Suite, TensorPipeRpcAgentTestFixture, SpawnHelper), {})``
(``torch.testing._internal.distributed.rpc_utils.generate_tests``).  :func:`build_classes`
does the same with :class:`TorchwireRpcAgentTestFixture` and :class:`ForkHelper`.

Import this module only after :func:`compat._alias.install` has run.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed.rpc as rpc
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

from _alias import MissingFeature

assert rpc.__name__.startswith("torchwire"), "compat._alias.install() must run first"

# (module under torch.testing._internal.distributed, class) in the order reported: the
# classes torch's rpc_utils.GENERIC_TESTS and TENSORPIPE_TESTS name that run on CPU.
SUITES = [
    ("rpc.rpc_test", "RpcTest"),
    ("rpc.rpc_test", "TensorPipeAgentRpcTest"),
    ("rpc.dist_autograd_test", "DistAutogradTest"),
    ("rpc.dist_autograd_test", "TensorPipeAgentDistAutogradTest"),
    ("rpc.dist_optimizer_test", "DistOptimizerTest"),
    ("rpc.examples.parameter_server_test", "ParameterServerTest"),
    ("rpc.examples.reinforcement_learning_rpc_test", "ReinforcementLearningRpcTest"),
    ("nn.api.remote_module_test", "RemoteModuleTest"),
    ("nn.api.remote_module_test", "ThreeWorkersRemoteModuleTest"),
    ("ddp_under_dist_autograd_test", "DdpUnderDistAutogradTest"),
    ("ddp_under_dist_autograd_test", "DdpComparisonTest"),
]

# rpc_utils.GENERIC_CUDA_TESTS and TENSORPIPE_CUDA_TESTS: run only with
# TORCHWIRE_COMPAT_CUDA=1 (a GPU machine), their workers spawned, since CUDA cannot be
# used in a child forked from a parent that asked CUDA anything.
CUDA_SUITES = [
    ("rpc.rpc_test", "CudaRpcTest"),
    ("rpc.rpc_test", "TensorPipeAgentCudaRpcTest"),
    ("rpc.dist_autograd_test", "CudaDistAutogradTest"),
    ("rpc.dist_autograd_test", "TensorPipeCudaDistAutogradTest"),
    ("nn.api.remote_module_test", "CudaRemoteModuleTest"),
    ("ddp_under_dist_autograd_test", "CudaDdpComparisonTest"),
]
CUDA = os.environ.get("TORCHWIRE_COMPAT_CUDA") == "1"


class TorchwireRpcAgentTestFixture(RpcAgentTestFixture):
    """What ``TensorPipeRpcAgentTestFixture`` gives torch's tests, with torchwire's options."""

    @property
    def rpc_backend(self):
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        # A fresh object per access, as torch's fixture builds one (tests mutate it).
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self):
        # Same as torch's TensorPipe fixture: any error counts as "the peer is gone".
        return "|".join(f"({e})" for e in [".*"])

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


class ForkHelper(MultiProcessTestCase):
    """torch's ``SpawnHelper``, forking the workers instead of spawning them.

    A forked worker inherits the imported torch, torchwire and the module aliases, so a
    test starts in well under a second instead of re-importing torch four times.
    """

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def run_test(self, test_name, parent_pipe):
        """In a worker: also fail the test when a thread of it hit a missing feature.

        Some of torch's tests do their work in threads and never look at how those
        threads ended; against a missing feature they would pass without testing
        anything.  Other exceptions in threads are left as torch's test handles them.
        """
        missed: list[BaseException] = []
        previous_hook = threading.excepthook

        def hook(args):
            if isinstance(args.exc_value, MissingFeature):
                missed.append(args.exc_value)
            previous_hook(args)

        test = getattr(self, test_name)

        def checked():
            # Off the instance again before the test runs: tests send bound methods of
            # the test case through RPC, which pickles the instance and its __dict__.
            delattr(self, test_name)
            try:
                test()
            except BaseException as exc:
                if missed:  # the thread's missing feature is the cause worth reporting
                    raise MissingFeature(f"in a thread of the test: {missed[0]}") from exc
                raise
            if missed:
                raise MissingFeature(f"in a thread of the test: {missed[0]}")

        threading.excepthook = hook
        setattr(self, test_name, checked)
        super().run_test(test_name, parent_pipe)


class SpawnHelper(ForkHelper):
    """:class:`ForkHelper` with spawned workers, for the CUDA suites."""

    def _start_processes(self, proc):
        super()._start_processes(torch.multiprocessing.get_context("spawn").Process)


def _fixture() -> type:
    """torch's own TensorPipe fixture under torchwire.patch alone, else torchwire's."""
    if os.environ.get("TORCHWIRE_COMPAT_PATCH_ONLY") == "1":
        from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
            TensorPipeRpcAgentTestFixture)
        return TensorPipeRpcAgentTestFixture
    return TorchwireRpcAgentTestFixture


def build_classes(module_name: str) -> dict[str, type]:
    """``{class name: runnable TestCase}`` for every suite in :data:`SUITES` (and
    :data:`CUDA_SUITES` under ``TORCHWIRE_COMPAT_CUDA=1``)."""
    import importlib

    classes = {}
    for module, name in SUITES + (CUDA_SUITES if CUDA else []):
        suite = getattr(importlib.import_module(
            f"torch.testing._internal.distributed.{module}"), name)
        helper = SpawnHelper if (module, name) in CUDA_SUITES else ForkHelper
        cls = type(name, (suite, _fixture(), helper), {})
        cls.__module__ = module_name
        cls.__qualname__ = name
        classes[name] = cls
    return classes
