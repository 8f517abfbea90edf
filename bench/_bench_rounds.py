"""Rounds of the benchmark: the long rounds (every metric, two fresh processes) and the
short alternating latency rounds.  Each runs under one thread setting
(``_bench_procs.thread_env``)."""

from __future__ import annotations

import queue as _queue
import statistics
import time

import _bench_worker
from _bench_procs import free_port, kill_all, thread_env


def lib_title(lib: str) -> str:
    return {"torch": "torch.distributed.rpc"}.get(lib, lib)


def _merge_network_round(r: dict, net: dict) -> None:
    """Fold the network-forced round's echo metrics into the round's result."""
    r["metrics"].update(net["metrics"])
    r["extra"].update(net["extra"])
    r["errors"] += [f"network-forced round: {e}" for e in net["errors"]]
    r["notes"] += [f"network-forced round: {n}" for n in net["notes"]]
    r["imported"] += net["imported"]
    r["timed_out"] = r["timed_out"] or net["timed_out"]
    r["clean_shutdown"] = r["clean_shutdown"] and net["clean_shutdown"]
    r["wall_s"] += net["wall_s"]


def run_round(ctx, lib: str, setting: str, cfg: dict, stall_timeout: float,
              round_timeout: float, shutdown_timeout: float, log) -> dict:
    """Run one round of ``lib``; returns a dict with metrics / errors / notes."""
    port = free_port()
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_bench_worker.child_main, args=(lib, rank, port, cfg, q),
                    name=f"bench-{lib}-worker{rank}", daemon=True)
        for rank in (0, 1)
    ]
    res = {"metrics": {}, "extra": {}, "errors": [], "notes": [], "timed_out": False,
           "clean_shutdown": False, "shutdown_s": None, "init_s": {}, "imported": []}
    t_start = time.monotonic()
    last_progress = t_start
    done = set()
    shutdown_times = {}
    rank0_done_at = None
    try:
        with thread_env(setting):
            for p in procs:
                p.start()
        while True:
            now = time.monotonic()
            # Deadlines -------------------------------------------------------
            if rank0_done_at is None:
                if now - last_progress > stall_timeout:
                    res["errors"].append(f"no progress for {stall_timeout:.0f} s (hang); killed")
                    res["timed_out"] = True
                    break
                if now - t_start > round_timeout:
                    res["errors"].append(f"round exceeded {round_timeout:.0f} s; killed")
                    res["timed_out"] = True
                    break
            else:
                if len(done) == 2 and not any(p.is_alive() for p in procs):
                    break
                if now - rank0_done_at > shutdown_timeout:
                    res["notes"].append(
                        f"shutdown did not finish within {shutdown_timeout:.0f} s; "
                        "processes killed")
                    break
            # Messages --------------------------------------------------------
            try:
                msg = q.get(timeout=0.25)
            except _queue.Empty:
                msg = None
            if msg is not None:
                last_progress = time.monotonic()
                kind = msg[0]
                if kind == "metric":
                    _, name, value, extra = msg
                    res["metrics"][name] = value
                    res["extra"][name] = extra
                    log(f"    {name} = {value:.4g}")
                elif kind == "ready":
                    res["init_s"][msg[1]] = msg[2]
                elif kind == "imported":
                    res["imported"].append(msg[2])
                    log(f"    worker{msg[1]} imported torchwire from {msg[2]}")
                elif kind == "note":
                    res["notes"].append(msg[1])
                elif kind == "error":
                    _, rank, where, text = msg
                    first = text.strip().splitlines()[0]
                    res["errors"].append(f"worker{rank} failed in {where}: {first}")
                    log(f"    ERROR worker{rank} in {where}:\n" + "\n".join(
                        "      " + line for line in text.rstrip().splitlines()))
                elif kind == "shutdown":
                    shutdown_times[msg[1]] = msg[2]
                elif kind == "done":
                    done.add(msg[1])
                    if msg[1] == 0:
                        rank0_done_at = time.monotonic()
                continue
            # A process that died without saying "done" ends the round. ----------
            dead = [(r, p.exitcode) for r, p in enumerate(procs)
                    if not p.is_alive() and r not in done]
            if dead:
                # Drain anything it managed to send first.
                time.sleep(0.2)
                while True:
                    try:
                        msg = q.get_nowait()
                    except (_queue.Empty, EOFError, OSError):
                        break
                    if msg[0] == "metric":
                        res["metrics"][msg[1]] = msg[2]
                        res["extra"][msg[1]] = msg[3]
                    elif msg[0] == "error":
                        first = msg[3].strip().splitlines()[0]
                        res["errors"].append(f"worker{msg[1]} failed in {msg[2]}: {first}")
                    elif msg[0] == "done":
                        done.add(msg[1])
                still_dead = [(r, c) for r, c in dead if r not in done]
                if still_dead:
                    if not res["errors"]:
                        res["errors"].append("; ".join(
                            f"worker{r} exited with code {c}" for r, c in still_dead))
                    break
    except KeyboardInterrupt:
        kill_all(procs)
        raise
    finally:
        kill_all(procs)
        try:
            q.close()
            q.cancel_join_thread()
        except Exception:
            pass
    if len(done) == 2 and not res["errors"]:
        res["clean_shutdown"] = True
        # worker0's: worker1 calls shutdown() right after init_rpc and waits in it
        # (graceful shutdown waits for every worker) while worker0 measures.
        res["shutdown_s"] = shutdown_times.get(0)
    res["wall_s"] = time.monotonic() - t_start
    return res


def run_interleaved(ctx, libs: list, settings: tuple, cfg: dict, log) -> dict:
    """Latency metrics measured in short rounds that alternate between the libraries and
    the thread settings.

    This machine's speed drifts several-fold within minutes, which the long rounds
    (every metric, ~30 s each) cannot absorb.  Here a short round starts a fresh pair
    of processes for one library, measures only the latency metrics (a few seconds),
    and shuts the pair down before the other library's round starts: each library
    runs alone, as in the long rounds, and the two sample the machine seconds apart.
    (An earlier version kept both pairs up and stopped the idle one with SIGSTOP; a
    stopped-and-continued torch pair measured 447 µs per no-op call against 248 µs
    when left running, so stopping was dropped.)  Returns ``{setting: {lib: {metric
    key: [value per short round]}}}`` plus ``{setting: {lib: {"errors": [...]}}}``.
    """
    outs = {}
    for setting in settings:
        outs[setting] = {lib: {"errors": [], "imported": []} for lib in libs}
    per_round = {(s, lib): [] for s in settings for lib in libs}
    titles = {lib: lib_title(lib) for lib in libs}
    n, warm = cfg["il_block"], cfg["il_warmup"]

    def short_round(setting, lib):
        out = outs[setting]
        cmd_q, res_q = ctx.Queue(), ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_bench_worker.interleaved_main,
                             args=(lib, rank, port, cfg, cmd_q, res_q),
                             name=f"bench-il-{lib}-worker{rank}", daemon=True)
                 for rank in (0, 1)]

        def get(timeout=120.0):
            try:
                msg = res_q.get(timeout=timeout)
            except _queue.Empty:
                raise RuntimeError(f"{titles[lib]}: no answer within {timeout:.0f} s") \
                    from None
            if msg[0] == "error":
                raise RuntimeError(f"{titles[msg[1]]}: {msg[2]}")
            return msg

        try:
            with thread_env(setting):
                for p in procs:
                    p.start()
            origin = get()[2]  # ready; worker0's torchwire/__init__.py (None for torch)
            if origin is not None and origin not in out[lib]["imported"]:
                out[lib]["imported"].append(origin)
                log(f"    {titles[lib]}: worker0 imported torchwire from {origin}")
            got = {}
            for metric in _bench_worker.INTERLEAVED:
                cmd_q.put(("block", metric, n, warm))
                got[metric] = get()[3]  # sorted
            cmd_q.put(("mp", cfg["il_mp_steps"], cfg["il_mp_warmup"]))
            steps = get()[3]  # sorted
            noop = got["sync_noop"]
            per_round[setting, lib].append({
                "il_sync_noop_median_us": statistics.median(noop),
                "il_sync_noop_p99_us": noop[min(len(noop) - 1, int(0.99 * len(noop)))],
                "il_sync_tensor16_median_us": statistics.median(got["sync_tensor16"]),
                "il_remote_to_here_median_us": statistics.median(got["remote_to_here"]),
                "il_rref_proxy_median_us": statistics.median(got["rref_proxy"]),
                "il_mp_step_median_ms": statistics.median(steps),
            })
        finally:
            cmd_q.put(("stop",))
            deadline = time.monotonic() + 60
            started = [p for p in procs if p.pid is not None]
            for p in started:
                p.join(max(0.1, deadline - time.monotonic()))
            kill_all(started)

    try:
        for block in range(cfg["il_blocks"]):
            for setting in (settings if block % 2 == 0 else settings[::-1]):
                for lib in (libs if block % 2 == 0 else libs[::-1]):
                    short_round(setting, lib)
            log(f"    short round {block + 1}/{cfg['il_blocks']} of each library and setting "
                "done")
    except Exception as exc:  # a failure or a hang (queue timeout): report, go on
        for setting in settings:
            for lib in libs:
                outs[setting][lib]["errors"].append(
                    f"short latency rounds: {type(exc).__name__}: {exc}")
        log(f"    short latency rounds failed: {exc}")
    for (setting, lib), rounds in per_round.items():
        for key in (rounds[0] if rounds else {}):
            outs[setting][lib][key] = [r[key] for r in rounds]
    return outs
