"""The distributed RNN: embedding table and decoder on a parameter server, LSTM on the trainer.

The model of the seeds' distributed-RNN example (and of torch's RPC tutorial),
learning a character-level language model of a few KB of public-domain text
shipped with torchwire (the Gettysburg Address and six of Shakespeare's sonnets).

Rank 0 is the parameter server ``ps``; ranks 1.. are trainers, each with its own
model.  Each model's ``EmbeddingTable`` and ``Decoder`` are created on the ps
with ``rpc.remote``; the ``nn.LSTM`` stays on the trainer.  The forward pass
goes trainer -> ps (embedding) -> trainer (LSTM) -> ps (decoder) -> trainer
(loss); ``torchwire.autograd.backward`` carries the gradients back through both
hops inside one context, and a ``DistributedOptimizer`` steps the parameters on
both workers.  At the end each trainer writes a sample of the text it learned.

    python -m torchwire.examples.rnn
    torchrun --nproc-per-node 2 -m torchwire.examples.rnn
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchwire.autograd as dist_autograd
import torchwire.rpc as rpc
from torchwire.examples import _common, _data
from torchwire.optim import DistributedOptimizer


# --------------------------------------------------- the seed's helpers and modules


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    """Run ``method(rref.local_value(), *args)`` on the owner of ``rref``."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args),
                        kwargs=kwargs)


def _parameter_rrefs(module):
    return [rpc.RRef(p) for p in module.parameters()]


def _set_training(module, mode: bool) -> None:
    module.train(mode)


class EmbeddingTable(nn.Module):
    """Encoding layers of the RNNModel (on the parameter server)."""

    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """Decoding layer of the RNNModel (on the parameter server)."""

    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    """Embedding table and decoder on the parameter server ``ps``, LSTM here."""

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params

    def train(self, mode: bool = True):
        super().train(mode)
        for rref in (self.emb_table_rref, self.decoder_rref):
            _remote_method(_set_training, rref, mode)
        return self


# --------------------------------------------------------------------------- training


def batchify(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``(len // batch, batch)``: each column a contiguous stretch of the text."""
    n = len(ids) // batch
    return ids[: n * batch].view(batch, n).t().contiguous()


def sample(model: RNNModel, vocab: str, prime: str, length: int, seed: int) -> str:
    """Generate ``length`` characters after ``prime`` (temperature 0.7)."""
    index = {c: i for i, c in enumerate(vocab)}
    g = torch.Generator().manual_seed(seed)
    model.train(False)
    hidden = None
    out = list(prime)
    x = torch.tensor([[index[c]] for c in prime])
    with torch.no_grad():
        for _ in range(length):
            logits, hidden = model(x, hidden)
            probs = F.softmax(logits[-1, 0] / 0.7, dim=0)
            nxt = int(torch.multinomial(probs, 1, generator=g))
            out.append(vocab[nxt])
            x = torch.tensor([[nxt]])
    return "".join(out)


def train(index: int, args) -> dict:
    """A trainer's loop (runs on the trainer, started by the ps)."""
    text = _data.corpus()
    vocab = "".join(sorted(set(text)))
    ids = torch.tensor([vocab.index(c) for c in text])
    data = batchify(ids, args.batch_size)
    torch.manual_seed(args.seed * 1000 + index)
    model = RNNModel("ps", len(vocab), args.emsize, args.nhid, args.nlayers)
    opt = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=args.lr)
    bar = _common.Progress(args, f"trainer{index}", index - 1, args.steps, "chars")
    losses, hidden, pos = [], None, 0
    model.train()
    for _ in range(args.steps):
        if pos + 1 >= len(data) - 1:
            pos, hidden = 0, None  # an epoch: start the text again
        seq = min(args.bptt, len(data) - 1 - pos)
        x, y = data[pos:pos + seq], data[pos + 1:pos + 1 + seq]
        pos += seq
        with dist_autograd.context() as context_id:
            if hidden is not None:  # truncated backpropagation through time
                hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(x, hidden)
            loss = F.cross_entropy(output.view(-1, len(vocab)), y.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        bar.update(x.numel(), loss=losses[-1])
    bar.close()
    return {"losses": losses, "sample": sample(model, vocab, "Shall I", 160, args.seed),
            "vocab": len(vocab), "chars": len(text)}


def drive(job: _common.Job) -> None:
    """On rank 0, the ps: runs the job, then prints the summary and saves the plot."""
    args = job.args
    n = job.world_size - 1
    t0 = time.perf_counter()
    futs = [rpc.rpc_async(f"trainer{i}", train, args=(i, args), timeout=0)
            for i in range(1, n + 1)]
    results = [f.wait() for f in futs]
    elapsed = time.perf_counter() - t0
    curves = [r["losses"] for r in results]
    k, first, last = _common.first_last(curves)
    chars = n * args.steps * args.batch_size * args.bptt
    _common.plot(args, f"distributed RNN: embedding + decoder on ps, LSTM on {n} trainer(s)",
                 {f"trainer{i + 1}": (range(1, len(c) + 1), _common.smooth(c))
                  for i, c in enumerate(curves)},
                 "step", "cross-entropy per character (smoothed)")
    rows = [
        ("corpus", f"{results[0]['chars']:,} characters, {results[0]['vocab']} distinct "
                   "(torchwire/examples/data/corpus.txt)"),
        ("loss", f"{first:.3f} -> {last:.3f} nats/char (mean of first and last {k} steps; "
                 f"uniform guess {math.log(results[0]['vocab']):.3f})"),
        ("throughput", f"{chars / elapsed:,.0f} characters/s"),
    ]
    for i, r in enumerate(results, 1):
        rows.append((f"trainer{i} writes", repr(r["sample"])))
    _common.summary(args, f"{n} trainer(s), {args.steps} steps each", rows, elapsed,
                    job.world_size, {"first_loss": first, "last_loss": last,
                                     "samples": [r["sample"] for r in results]})


def worker(job: _common.Job) -> None:
    _common.drive_or_serve(job, drive, "ps", "trainer")


def main(argv=None) -> int:
    p = _common.parser("rnn", __doc__, world_size=2, steps=600, lr=0.005, batch_size=16)
    p.add_argument("--bptt", type=int, default=32, help="characters per sequence (default 32)")
    p.add_argument("--emsize", type=int, default=32, help="embedding size (default 32)")
    p.add_argument("--nhid", type=int, default=128, help="LSTM hidden size (default 128)")
    p.add_argument("--nlayers", type=int, default=2, help="LSTM layers (default 2)")
    return _common.launch(worker, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
