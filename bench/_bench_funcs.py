"""Functions executed remotely by the benchmark.

They live in their own importable module (``_bench_funcs``) so that both
torch.distributed.rpc and torchwire.rpc pickle them by reference.
"""


def noop():
    return None


def echo(x):
    return x


def one():
    return 1


class Box:
    """A value held on the owner of an RRef; the proxy benchmark calls ``get``."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value

# --------------------------------------------------------------------------- model-parallel step
# remote embedding (worker1) -> local layer (worker0) -> remote decoder (worker1)

MP_VOCAB, MP_DIM, MP_BATCH, MP_BAG = 1000, 32, 16, 8


def mp_embedding():
    import torch
    torch.manual_seed(1)
    return torch.nn.EmbeddingBag(MP_VOCAB, MP_DIM, mode="mean")


def mp_decoder():
    import torch
    torch.manual_seed(2)
    return torch.nn.Linear(MP_DIM, MP_VOCAB)


def mp_forward(module_rref, *args):
    return module_rref.local_value()(*args)


def mp_param_rrefs(module_rref):
    rref_cls = type(module_rref)  # the library's RRef: torch's or torchwire's
    return [rref_cls(p) for p in module_rref.local_value().parameters()]


def rss_mib():
    """(current RSS, peak RSS since the last reset) of this process, in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss():
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
