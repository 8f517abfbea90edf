"""Functions executed remotely by the benchmark.

They live in their own importable module (``_bench_funcs``) so that both
torch.distributed.rpc and torchwire.rpc pickle them by reference.
"""


def noop():
    return None


def echo(x):
    return x
