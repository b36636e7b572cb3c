"""Triton's statistics of one server made of several worker processes: each version's figures added up across the
workers, batch sizes merged, the latest inference kept, and versions a worker does not serve left out."""

from __future__ import annotations

from mhaserve.server.describe import merged_statistics


def stats(name="mha", version="1", rows=0, last=0, success=(0, 0), batches=()) -> dict:
    def duration(count=0, ns=0):
        return {"count": count, "ns": ns}

    return {
        "name": name,
        "version": version,
        "last_inference": last,
        "inference_count": rows,
        "execution_count": len(batches),
        "inference_stats": {
            "success": duration(*success),
            **{part: duration() for part in ("fail", "queue", "compute_input", "compute_infer", "compute_output")},
        },
        "batch_stats": [
            {"batch_size": size, **{part: duration(count, ns) for part in ("compute_input", "compute_infer",
                                                                            "compute_output")}}
            for size, count, ns in batches
        ],
    }  # fmt: skip


def test_each_version_s_figures_are_added_up_across_the_workers():
    own = [stats(rows=3, last=100, success=(3, 30), batches=[(1, 3, 30)])]
    other = [stats(rows=5, last=250, success=(4, 70), batches=[(1, 2, 20), (2, 1, 50)])]
    (merged,) = merged_statistics(own, [other])
    assert merged["inference_count"] == 8 and merged["execution_count"] == 3 and merged["last_inference"] == 250
    assert merged["inference_stats"]["success"] == {"count": 7, "ns": 100}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in merged["batch_stats"]] == [(1, 5), (2, 1)]
    assert own[0]["inference_count"] == 3  # this worker's own figures are left as they were


def test_a_version_only_another_worker_serves_is_not_added_and_a_silent_worker_changes_nothing():
    own = [stats(version="1", rows=2)]
    merged = merged_statistics(own, [[stats(version="2", rows=9)], []])
    assert merged == own


def test_live_parity_s_checks_are_added_up_and_the_worst_error_is_the_worst_of_any_worker():
    parity = {"share": 0.5, "checked": 3, "held": 3, "breached": 0, "dropped": 1, "pending": 0,
              "worst_error": {"output": 2e-7}}  # fmt: skip
    theirs = {**parity, "checked": 4, "held": 3, "breached": 1, "worst_error": {"output": 0.3, "attn_weights": 1e-8}}
    (merged,) = merged_statistics([{**stats(), "parity": parity}], [[{**stats(), "parity": theirs}]])
    assert merged["parity"] == {"share": 0.5, "checked": 7, "held": 6, "breached": 1, "dropped": 2, "pending": 0,
                                "worst_error": {"output": 0.3, "attn_weights": 1e-8}}  # fmt: skip
    assert parity["worst_error"] == {"output": 2e-7}  # this worker's own figures are left as they were
    (only_theirs,) = merged_statistics([stats()], [[{**stats(), "parity": theirs}]])
    assert only_theirs["parity"] == theirs
