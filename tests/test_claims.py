"""Every number in the README's "Numbers" section is read from the results file it cites.

Each claim below is rebuilt from its file and must appear in the README as written (line breaks aside).
Then every number left in the section must be one of those values, a workload size from the same files,
or part of a citation (a date, a version, a file name): a number added without a source fails here.
"""

import json
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEVICE_CHECK = "2026-12-04-h200-device-check.json"
DIAG = "2026-12-04-h200-diag.json"
DEVICE_CHECK_LOGS = "2026-12-04-h200-device-check-logs.tar.gz"
PLAN_ACCURACY = "2026-12-01-cpu-2core-plan-accuracy.md"
MiB = 1 << 20


def section(text: str, heading: str) -> str:
    body = text.split(f"## {heading}\n", 1)[1]
    return " ".join(body.split("\n## ", 1)[0].split())  # one line: claims may wrap anywhere


def one(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"{len(found)} rows match {match}"
    return found[0]


def logs_member(archive: str, name: str) -> str:
    with tarfile.open(RESULTS / archive) as tar:
        return tar.extractfile(name).read().decode()


def first_gptq_s(log: str) -> str:
    """The first GPTQ step's time in a oneshot log: llm-compressor's first run, which pays the warm-up."""
    return re.search(r"GPTQ \| METRIC - time ([0-9.]+)s", log)[1]


def device_check_claims() -> tuple[list[str], set[str]]:
    """The H200 device check's claims as the README words them, and the workload sizes they name."""
    d = json.loads((RESULTS / DEVICE_CHECK).read_text())
    big = 64 * MiB

    def gbps(impl, direction):
        return one(d["transfer"], impl=impl, direction=direction, bytes=big)["gbps"]

    duplex = one(d["overlap"], case="duplex")

    def small(impl, direction):
        return one(d["small"], impl=impl, direction=direction, count=1000, bytes_each=4096)["us_per_tensor"]

    def batch(impl):
        return one(d["small"], impl=impl, direction="fetch_batch_of_5", offload_device="cpu")["us_per_batch"]

    def pipe(impl):
        return one(d["pipeline"], impl=impl)["wall_s"] * 1000

    def oneshot(impl, prefetch):
        return one(d["oneshot"], impl=impl, prefetch=prefetch)

    assert all(r["bit_identical"] for r in d["oneshot"] if r["impl"] == "offcache")
    assert all(r.get("repeats", 1) == 1 for r in d["oneshot"])  # "one run each"
    oneshot_log = logs_member(DEVICE_CHECK_LOGS, "logs/oneshot.log")
    claims = [
        f"fetch (H2D) of 64 MiB at {gbps('offcache', 'fetch'):.1f} GB/s, raw pinned `copy_` "
        f"{gbps('raw_pinned', 'fetch'):.1f}",
        f"duplex {duplex['gbps']:.1f} GB/s, {duplex['ratio_to_one_direction']:.2f}× one direction",
        f"1000 tensors of 4 KiB: {small('offcache', 'store'):.2f} µs each stored, "
        f"{small('offcache', 'fetch'):.2f} fetched (one `copy_` each: {small('per_tensor_copy', 'store'):.2f} / "
        f"{small('per_tensor_copy', 'fetch'):.2f} µs)",
        f"five fetched from the CPU in {batch('offcache'):.1f} µs, llm-compressor's {batch('llmcompressor'):.1f}",
        f"`iter_prefetch`: {pipe('offcache_iter_prefetch'):.0f} ms, llm-compressor's "
        f"{pipe('llmcompressor_iter'):.0f} ms ({pipe('llmcompressor_iter_prefetch'):.0f} ms with its prefetch thread)",
        f"GPTQ oneshot, one run each: {oneshot('offcache', False)['speedup_vs_llmcompressor']:.2f}× llm-compressor's "
        f"speed without `sequential_prefetch` (its run paid {first_gptq_s(oneshot_log)} s of warm-up), "
        f"{oneshot('offcache', True)['speedup_vs_llmcompressor']:.2f}× with it on both sides; bit-identical",
        f"a 64 MiB store dropped at once runs at {gbps('offcache', 'store'):.1f} GB/s",
    ]
    return claims, {"64", "1000", "4", "five"}


def kv_claims() -> tuple[list[str], set[str]]:
    """The dynamic KV cache against transformers' offloading: the diagnosis run, not the device check."""
    kv = json.loads((RESULTS / DIAG).read_text())["kv"]

    def ratio(case):
        ours = one(kv, impl="offcache", case=case)
        theirs = one(kv, impl="transformers_offloaded", case=case)
        assert ours["equal_to_dynamic"] and ours["prompt_tokens"] == theirs["prompt_tokens"]
        return ours["decode_tokens_per_s_median"] / theirs["decode_tokens_per_s_median"], ours["prompt_tokens"]

    (short, n_short), (long, n_long) = ratio("short"), ratio("long")
    claims = [
        f"decodes at {short:.2f}× / {long:.2f}× transformers' offloading (prompts of {n_short} / {n_long} tokens; "
        f"`benchmarks/results/{DIAG}`)"
    ]
    return claims, {str(n_short), str(n_long)}


def plan_claims() -> tuple[list[str], set[str]]:
    """The planner's accuracy on the CPU: exact with samples of one length, an upper bound otherwise."""
    rows = re.findall(
        r"^\| (\w+) \| [^|]+ \| \d+ \| ([^|]+) \| \d+ \| \d+ \| ([0-9.]+) \|",
        (RESULTS / PLAN_ACCURACY).read_text(),
        re.M,
    )
    one_length = [(fam, float(r)) for fam, opts, r in rows if "lengths" not in opts]
    varied = [float(r) for fam, opts, r in rows if "lengths" in opts]
    assert one_length and all(r == 1.0 for _, r in one_length)
    assert varied and min(varied) >= 1.0
    families = len({fam for fam, _ in one_length})
    cores = re.search(r"(\d+) cores", (RESULTS / PLAN_ACCURACY).read_text())[1]
    claims = [
        f"On a {cores}-core CPU",
        f"the planner's cache peak equalled the measured one on {families} model families "
        f"(an upper bound, up to {max(varied):.2f}×, with samples of varied lengths)",
    ]
    return claims, {str(families)}


def test_every_readme_number_comes_from_the_file_it_cites():
    numbers = section((ROOT / "README.md").read_text(), "Numbers")
    sources = (device_check_claims(), kv_claims(), plan_claims())
    for claims, _ in sources:
        for claim in claims:
            assert claim in numbers, f"the README does not say, as its file does: {claim!r}"
    assert f"`benchmarks/results/{DEVICE_CHECK}`" in numbers
    # Every number left must be a claim's, a workload size, or a citation's (dates, versions, files).
    allowed = {n for claims, sizes in sources for claim in claims for n in re.findall(r"[0-9][0-9.]*", claim)}
    allowed |= {n for _, sizes in sources for n in sizes}
    citations = re.sub(r"`[^`]*`|\d{4}-\d\d-\d\d|torch [0-9.]+\+cu\d+|NVIDIA H\d+|\[[^]]*\]\([^)]*\)", " ", numbers)
    stray = [n.rstrip(".") for n in re.findall(r"[0-9][0-9.]*", citations) if n.rstrip(".") not in allowed]
    assert not stray, f"README numbers with no source: {stray}"


def test_a_claim_that_drifts_from_its_file_fails(tmp_path, monkeypatch):
    """The check above can fail: a results file that says otherwise no longer matches the README."""
    d = json.loads((RESULTS / DEVICE_CHECK).read_text())
    one(d["oneshot"], impl="offcache", prefetch=True)["speedup_vs_llmcompressor"] = 2.5
    (tmp_path / DEVICE_CHECK).write_text(json.dumps(d))
    (tmp_path / DEVICE_CHECK_LOGS).write_bytes((RESULTS / DEVICE_CHECK_LOGS).read_bytes())
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", tmp_path)
    numbers = section((ROOT / "README.md").read_text(), "Numbers")
    claims, _ = device_check_claims()
    assert any(c not in numbers for c in claims)
