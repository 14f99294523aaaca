"""bench/issue24_check.py: each of issue 24's points judged from synthetic JSON of the two
tools (the shapes of their output, not a run's numbers)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "issue24_check.py"


@pytest.fixture(scope="module")
def checker():
    if not SCRIPT.exists():
        pytest.skip("bench/ is not beside the package here")
    spec = importlib.util.spec_from_file_location("issue24_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peers_json(device="NVIDIA H200", d64_fraction=0.94, liger_d64_ms=0.0346):
    """compare_torch --in-place's JSON at the issue's four shapes, every point met."""
    shapes = []
    for (B, S, Hq, Hk, D), fraction, ours in (((4, 4096, 32, 8, 128), 0.958, 0.0820),
                                              ((1, 32768, 32, 8, 128), 0.971, 0.1649),
                                              ((8, 2048, 16, 16, 64), d64_fraction, 0.0338),
                                              ((2, 4096, 16, 8, 256), 0.961, 0.0498)):
        liger = liger_d64_ms if D == 64 else ours * 1.05
        shapes.append({
            "B": B, "S": S, "Hq": Hq, "Hk": Hk, "D": D,
            "graph_time_ms": {"rope_jit": ours, "torch_compile": ours * 2, "liger": liger},
            "graph_fraction_of_copy": {"rope_jit": fraction},
            "graph_fraction_of_issue_copy": {"rope_jit": fraction + 0.001},
            "same_size_copy_fraction_of_copy": 0.94,
        })
    return {"device": device, "shapes": shapes}


def bench_json(device="NVIDIA H200", d80=0.927, partial=0.90):
    def case(name, fraction, in_place=True, rotary_dim=128, D=128):
        return {"name": name, "fraction_of_copy": fraction, "in_place": in_place,
                "rotary_dim": rotary_dim, "D": D}
    return {"device": device, "cases": [
        case("D64 MHA", 0.934, rotary_dim=64, D=64), case("D80 MHA", d80, rotary_dim=80, D=80),
        case("D96 MHA", 0.938, rotary_dim=96, D=96), case("llama3-8b interleaved", 0.973),
        case("llama3-8b prefill bhsd", 0.951),
        case("D64 bhsd interleaved", 0.931, rotary_dim=64, D=64),
        case("phi-2 partial 32/80", 0.51, rotary_dim=32, D=80),  # in place: not a point
        case("phi-2 partial 32/80 out of place", partial, in_place=False, rotary_dim=32, D=80),
    ]}


def missed(lines):
    return [line for line in lines if line.startswith("MISSED")]


def test_every_point_met_on_an_h200_is_done(checker):
    lines, done = checker.check(peers_json(), bench_json())
    assert done
    assert not missed(lines)
    # 4 shapes x (2 peers + fraction), 6 named cases, 1 out-of-place partial case.
    assert lines[-1] == "19 of 19 points held: issue 24 done"


def test_each_kind_of_miss_is_named(checker):
    lines, done = checker.check(peers_json(d64_fraction=0.927), bench_json())
    assert not done and len(missed(lines)) == 1 and "8,2048,16,16,64: of copy" in missed(lines)[0]
    lines, done = checker.check(peers_json(liger_d64_ms=0.0330), bench_json())
    assert not done and "8,2048,16,16,64: faster than liger" in missed(lines)[0]
    lines, done = checker.check(peers_json(), bench_json(d80=0.91))
    assert not done and "D80" in missed(lines)[0]
    lines, done = checker.check(peers_json(), bench_json(partial=0.87))
    assert not done and "phi-2 partial 32/80 out of place" in missed(lines)[0]
    bench = bench_json()
    bench["cases"] = [case for case in bench["cases"] if case["name"] != "D96 MHA"]
    lines, done = checker.check(peers_json(), bench)
    assert not done and "D96" in missed(lines)[0]


def test_another_gpu_is_not_done(checker):
    lines, done = checker.check(peers_json(device="NVIDIA H100 80GB HBM3"),
                                bench_json(device="NVIDIA H100 80GB HBM3"))
    assert not done
    assert not missed(lines)
    assert "not on an H200" in lines[-1]
