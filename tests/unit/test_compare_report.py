"""The comparison table shows buffer and wire bytes per step, each with its ratio to DDP."""

from __future__ import annotations

from sdp_train.compare_report import markdown_table


def _row(mode: str, buffer: float, wire: float | None, **ratios) -> dict:
    return {"mode": mode, "active": None, "steps": 2, "final_val_loss": 3.0,
            "peak_memory_bytes": {"total": 2**20}, "comm_bytes_per_step": buffer, "wire_bytes_per_step": wire,
            "step_time_s": 0.1, "bound_vs_ddp": None, **ratios}


def test_table_has_a_wire_column_with_its_own_ratio_to_ddp():
    report = {
        "command": "sdp compare --preset x", "machine": "test", "date": "2026-12-03",
        "settings": {"model": "llama-debug", "workers": 4, "batch_size": 2, "seq_len": 16, "lr": 1e-3},
        "runs": {"ddp": _row("ddp", 2**20, 1.5 * 2**20, wire_bytes_per_step_vs_ddp=1.0),
                 "fsdp": _row("fsdp", 3 * 2**20, 2.25 * 2**20, comm_bytes_per_step_vs_ddp=3.0,
                              wire_bytes_per_step_vs_ddp=1.5),
                 "old": _row("bsdp", 2**19, None)},
    }
    lines = markdown_table(report).splitlines()
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    fsdp = [c.strip() for c in next(line for line in lines if line.startswith("| fsdp")).strip("|").split("|")]
    old = [c.strip() for c in next(line for line in lines if line.startswith("| old")).strip("|").split("|")]
    at = header.index("wire MiB/step")
    assert header[at - 2] == "buffer MiB/step"
    assert fsdp[at - 2: at + 2] == ["3.00", "3.00", "2.25", "1.50"]
    assert old[at: at + 2] == ["-", "-"]  # a summary written before wire bytes existed
    assert "ring model" in lines[0]


def test_a_failed_runslog_tail_shows_the_ranks_error_not_the_launchers_lines():
    from sdp_train.compare import log_tail

    log = ("step 1 loss 5.0\n"
           "sdp train: error: config.json: no such file\n"
           "W1204 15:48:12.325000 23405 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1 closing signal SIGTERM\n"
           "E1204 15:48:12.357000 23405 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0\n"
           "sdp: worker failed: rank 0 (exit code 2); stopped by the launcher after it: ranks 1, 2\n")
    tail = log_tail(log, lines=2)
    assert tail.splitlines() == ["sdp train: error: config.json: no such file",
                                 "sdp: worker failed: rank 0 (exit code 2); stopped by the launcher after it: ranks 1, 2"]
