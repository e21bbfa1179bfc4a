"""The comparison table shows buffer and wire bytes per step, each with its ratio to DDP."""

from __future__ import annotations

import math

import pytest

from sdp_train.compare.report import markdown_table


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


def _summary(loss: float, memory: float, step_time: float, steps: int = 2) -> dict:
    return {"config": {"steps": steps, "mask": None}, "final_train_loss": loss, "final_val_loss": loss,
            "peak_memory_bytes": [{"total": memory}], "comm_bytes_per_step": memory / 8,
            "wire_bytes_per_step": memory / 4, "step_time_s": step_time, "tokens_per_s": 1.0 / step_time,
            "val_history": [{"step": 0, "val_loss": loss + 1}]}


def test_two_seeds_add_a_seed_table_and_say_which_differences_exceed_the_spread(tmp_path):
    from sdp_train.compare.runner import Planned, Preset, RunSpec, build_report
    from sdp_train.compare.stats import LARGER, WITHIN
    from sdp_train.trainer.config import TrainConfig

    preset = Preset(model="llama-debug", workers=2, steps=2, batch_size=2, seq_len=16, lr=1e-3, warmup_steps=0)
    planned = [Planned(RunSpec(name, mode), TrainConfig(mode=mode, steps=2), None, 1.0, None)
               for name, mode in (("ddp", "ddp"), ("fsdp", "fsdp"), ("nsdp", "ddp"))]
    # fsdp follows DDP's loss at each seed; nsdp is worse by 0.5 at both, while DDP's own loss
    # moves by 1.0 between the seeds: paired by seed the 0.5 is outside the spread
    summaries = {0: {"ddp": _summary(3.0, 2**20, 0.10), "fsdp": _summary(3.0, 2**19, 0.20),
                     "nsdp": _summary(3.5, 2**19, 0.10)},
                 1: {"ddp": _summary(4.0, 2**20, 0.10), "fsdp": _summary(4.0, 2**19, 0.30),
                     "nsdp": _summary(4.5, 2**19, 0.12)}}
    report = build_report("x", preset, planned, summaries)
    assert report["command"] == "sdp compare --preset x --seeds 2" and report["seeds"] == [0, 1]
    assert report["runs"] == report["seed_runs"]["0"] and report["seed_runs"]["1"]["ddp"]["final_val_loss"] == 4.0
    stats = report["seed_stats"]["runs"]
    assert stats["nsdp"]["final_val_loss_minus_ddp"]["mean"] == 0.5
    assert stats["nsdp"]["final_val_loss_minus_ddp"]["verdict"] == LARGER
    assert stats["fsdp"]["final_val_loss_minus_ddp"]["verdict"] == WITHIN
    assert stats["fsdp"]["step_time_s_vs_ddp"]["mean"] == pytest.approx(2.5)
    assert stats["fsdp"]["peak_memory_vs_ddp"]["sd"] == 0.0

    lines = markdown_table(report).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Over 2 seeds (0, 1"))
    header = [c.strip() for c in lines[at + 2].strip("|").split("|")]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[at + 4: at + 7])}
    assert header[:4] == ["run", "val loss (mean ± sd)", "- DDP", "difference to DDP"]
    assert rows["nsdp"][1] == "4.0000 ± 0.7071" and rows["nsdp"][2] == "0.5000 [0.5000, 0.5000]"
    assert rows["nsdp"][3] == LARGER and rows["fsdp"][3] == WITHIN and rows["ddp"][3] == WITHIN
    t = 12.7062  # two-sided 95% Student t, 1 degree of freedom
    sd = math.sqrt(0.5)  # of fsdp's step-time ratios 2 and 3
    low, high = 2.5 - t * sd / math.sqrt(2), 2.5 + t * sd / math.sqrt(2)
    assert rows["fsdp"][header.index("step s x")] == f"2.50 [{low:.2f}, {high:.2f}]"
    assert rows["fsdp"][header.index("peak x")] == "0.50 [0.50, 0.50]"
    # one seed: the report and table are today's, with no seed keys
    single = build_report("x", preset, planned, {0: summaries[0]})
    assert "seed_stats" not in single and single["command"] == "sdp compare --preset x"
    assert not any(line.startswith("Over ") for line in markdown_table(single).splitlines())


def test_a_failed_runslog_tail_shows_the_ranks_error_not_the_launchers_lines():
    from sdp_train.compare.runner import log_tail

    log = ("step 1 loss 5.0\n"
           "sdp train: error: config.json: no such file\n"
           "W1204 15:48:12.325000 23405 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1 closing signal SIGTERM\n"
           "E1204 15:48:12.357000 23405 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0\n"
           "sdp: worker failed: rank 0 (exit code 2); stopped by the launcher after it: ranks 1, 2\n")
    tail = log_tail(log, lines=2)
    assert tail.splitlines() == ["sdp train: error: config.json: no such file",
                                 "sdp: worker failed: rank 0 (exit code 2); stopped by the launcher after it: ranks 1, 2"]


def test_bound_column_is_a_guarantee_only_where_a_theorem_covers_the_run():
    report = {
        "command": "sdp compare --preset x", "machine": "test", "date": "2026-12-07",
        "settings": {"model": "llama-debug", "workers": 4, "batch_size": 2, "seq_len": 16, "lr": 1e-3},
        "runs": {"sgd": _row("bbsdp", 1.0, 1.0, bound_vs_ddp=1.5),
                 "adamw": _row("bbsdp", 1.0, 1.0, sgd_bound_vs_ddp=1.5),
                 "adamw-static-overlap": _row("overlap", 1.0, 1.0, sgd_bound_vs_ddp=None, sgd_bound_infinite=True),
                 "forward": _row("bsdp", 1.0, 1.0, sgd_bound_vs_ddp=None)},
    }
    lines = markdown_table(report).splitlines()
    cells = {line.split("|")[1].strip(): line.strip("|").split("|")[-1].strip() for line in lines
             if line.startswith("| ") and not line.startswith("| run")}
    assert cells == {"sgd": "1.50", "adamw": "(1.50)", "adamw-static-overlap": "(inf)", "forward": "-"}
    assert "design figure (heuristic), not a guarantee" in lines[0] and "AdamW" in lines[0]
