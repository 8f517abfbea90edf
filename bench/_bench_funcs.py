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
