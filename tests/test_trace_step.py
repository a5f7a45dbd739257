"""benchmarks/trace_step.py's reduction of a profiler trace: a GPU-shaped Chrome trace written
here, whose figures are known, reduced to the table the device run brings back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).parent.parent / "benchmarks" / "trace_step.py"
_spec = importlib.util.spec_from_file_location("trace_step", _PATH)
trace_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_step)


def _gpu_trace() -> dict:
    """Two steps of 1,000 us on a host thread named "python"; a GPU stream's kernels inside
    them; the host's graph launches and one device-to-host copy in the second step."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 20, "args": {"name": "Stream #7"}},
    ]

    def span(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = []
    for start in (0.0, 2000.0):
        events.append(span(1, 10, "engine_step", start, 1000))
        events.append(span(1, 10, "cuGraphLaunch", start + 5, 10))
        # gemm 400 us, a 100 us gap, then two small kernels of 50 us
        events.append(span(2, 20, "gemm_fusion_dot.12", start + 20, 400))
        events.append(span(2, 20, "loop_multiply_fusion.3", start + 520, 50))
        events.append(span(2, 20, "loop_multiply_fusion.17", start + 570, 50))
    events.append(span(1, 10, "MemcpyDtoH", 2700, 20))
    events.append(span(2, 20, "outside_any_step", 5000, 300))
    return {"traceEvents": meta + events}


def test_a_gpu_trace_reduces_to_kernels_gaps_launches_and_syncs():
    r = trace_step.reduce_trace(_gpu_trace(), top=5)
    assert r["source"] == "gpu" and r["steps"] == 2
    m = r["median"]
    assert m["step_us"] == 1000 and m["kernels"] == 3
    assert m["busy_us"] == pytest.approx(500) and m["idle_us"] == pytest.approx(500)
    # the 100 us stretch between the gemm and the norm; the time before the first kernel and
    # after the last is the step's edges, not a gap between kernels
    assert m["gaps"] == 1 and m["gap_us"] == pytest.approx(100)
    assert m["launches"] == 1 and m["graph_launches"] == 1
    assert [p["host_syncs"] for p in r["per_step"]] == [0, 1]
    assert r["sync_names"] == ["MemcpyDtoH"]
    # kernels grouped by kind, instance numbers dropped; the one outside every step not counted
    kinds = {k["name"]: k for k in r["top_kernels"]}
    assert set(kinds) == {"gemm_fusion_dot", "loop_multiply_fusion"}
    assert kinds["loop_multiply_fusion"]["per_step"] == 2
    assert kinds["gemm_fusion_dot"]["us_per_step"] == pytest.approx(400)
    assert kinds["gemm_fusion_dot"]["share"] == pytest.approx(0.8)
    assert "gemm_fusion_dot" in trace_step.render(r, "t")


def test_a_trace_without_step_annotations_is_refused():
    trace = _gpu_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != "engine_step"]
    with pytest.raises(ValueError, match="engine_step"):
        trace_step.reduce_trace(trace)
