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


# --------------------------------------------------------------------------- fresh tensors
# The callee returns a tensor it creates, as programs do (a result, a gradient, a
# parameter): not the buffer it received.

def fresh_clone(x):
    return x.clone()


def fresh_mul2(x):
    return x * 2


# --------------------------------------------------------------------------- state dicts
# A state dict as a parameter server or a checkpointing worker moves it: 250 tensors of
# ResNet-like sizes (convolutions of 64..512 channels, each with 4 per-channel vectors),
# 173 MiB in all.  Pulled: the callee returns a fresh copy of the one it keeps.
# Pushed: the callee reads every tensor it received.

_state_dict: dict = {}


def state_dict_make():
    import torch
    g = torch.Generator().manual_seed(0)
    shapes = []
    for i in range(50):
        c = 64 * (1 + i % 8)
        shapes += [(c, c, 3, 3), (c,), (c,), (c,), (c,)]
    return {f"layer{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


def state_dict_pull():
    if not _state_dict:
        _state_dict.update(state_dict_make())
    return {k: v.clone() for k, v in _state_dict.items()}


def state_dict_push(sd):
    return sum(float(v.sum()) for v in sd.values())


# --------------------------------------------------------------------------- parameter server
# One server holds the model; trainers pull its parameters, compute a gradient on a
# batch of their own, and push it.  Module state lives in the server process only.

PS_IN, PS_HIDDEN, PS_OUT = 1024, 2048, 1024  # 2 x 2M weights + biases: 16 MiB of float32
PS_BATCH = 16
PS_LR = 1e-3
_ps: dict = {}


def ps_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(PS_IN, PS_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(PS_HIDDEN, PS_OUT))


def ps_setup(trainers):
    """On the server: the model, its lock, and a barrier the trainers meet at."""
    import threading
    import torch
    model = ps_model()
    with torch.no_grad():
        params = [p.detach().clone() for p in model.parameters()]
    _ps.update(params=params, lock=threading.Lock(),
               barrier=threading.Barrier(trainers, timeout=120))
    return sum(p.numel() * p.element_size() for p in params)


def ps_pull():
    """The current parameters, as fresh tensors (a snapshot taken under the lock)."""
    with _ps["lock"]:
        return [p.clone() for p in _ps["params"]]


def ps_push(grads):
    with _ps["lock"]:
        for p, g in zip(_ps["params"], grads):
            p.add_(g, alpha=-PS_LR)


def ps_meet():
    """Blocks until every trainer has arrived (the timed steps start together)."""
    _ps["barrier"].wait()
