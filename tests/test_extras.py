"""A missing optional package gives one line naming the extra that installs it; import makes nothing on disk.

Absence is simulated in a fresh interpreter by a sys.meta_path finder that refuses the package.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offcache.engine import machine as _machine

ROOT = Path(__file__).resolve().parent.parent


def without(packages: tuple[str, ...], code: str, tmp_path: Path, argv0: str = "-c") -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which `packages` cannot be imported."""
    prelude = f"""
        import sys
        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {packages!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Missing())
        sys.argv[0] = {argv0!r}
    """
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)], cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=600)  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr[-2000:]
    return lines[0]


def test_patch_llmcompressor_without_llmcompressor(tmp_path):
    proc = without(("llmcompressor",), """
        import offcache
        try:
            offcache.patch_llmcompressor()
        except ImportError as exc:
            print(type(exc).__name__, exc)
        offcache.unpatch_llmcompressor()  # nothing to restore: no error either
    """, tmp_path)  # fmt: skip
    line = one_line_error(proc)
    assert line == ("MissingExtraError offcache.patch_llmcompressor() needs llmcompressor, which is not installed: "
                    "pip install 'offcache[llmcompressor]'")  # fmt: skip


@pytest.mark.parametrize("name", ["OffloadedKVCache", "OffloadedStaticKVCache"])
def test_kv_caches_without_transformers(tmp_path, name):
    proc = without(("transformers",), f"""
        import offcache
        try:
            offcache.{name}
        except ImportError as exc:
            print(exc)
    """, tmp_path)  # fmt: skip
    expected = f"offcache.{name} needs transformers, which is not installed: pip install 'offcache[kv]'"
    assert one_line_error(proc) == expected


@pytest.mark.parametrize("argv", [["--config", "some/model", "--samples", "4", "--seq-len", "64"],
                                  ["kv", "--config", "some/model", "--tokens", "64"]])  # fmt: skip
def test_plan_config_without_transformers(tmp_path, argv):
    proc = without(("transformers",), f"""
        import offcache.plan as plan
        plan.main({argv!r})
    """, tmp_path)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "needs transformers, which is not installed: pip install 'offcache[transformers]'" in lines[0]


@pytest.mark.parametrize("argv0, prog", [("-m", "python -m offcache.bench"),
                                         ("/usr/local/bin/offcache-bench", "offcache-bench")])  # fmt: skip
def test_bench_help_without_matplotlib(tmp_path, argv0, prog):
    proc = without(("matplotlib",), """
        from offcache.bench.__main__ import main
        main(["--help"])
    """, tmp_path, argv0=argv0)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {prog} ")


def test_bench_skips_a_section_whose_peer_is_missing_and_draws_what_it_can(tmp_path):
    """The main job without transformers: the kv section is skipped, said why, the others' plots drawn."""
    out = tmp_path / "out"
    proc = without(("transformers",), f"""
        import sys
        from offcache.bench.__main__ import main
        sys.exit(main(["transfer", "kv", "--tiny", "--out", {str(out)!r}]))
    """, tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    why = "section kv skipped: it needs transformers, which is not installed: pip install 'offcache[kv]'"
    assert why in proc.stderr and why in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["skipped"] == {"kv": why} and "kv" not in results and results["transfer"]
    assert [Path(p).name for p in results["plots"]] == ["bandwidth.png"] and (out / "bandwidth.png").exists()


def test_bench_without_matplotlib_writes_its_results_and_says_why_there_are_no_plots(tmp_path):
    out = tmp_path / "out"
    proc = without(("matplotlib",), f"""
        import sys
        from offcache.bench.__main__ import main
        sys.exit(main(["transfer", "--tiny", "--out", {str(out)!r}]))
    """, tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plots not drawn: they need matplotlib, which is not installed: pip install 'offcache[bench]'" in proc.stderr
    assert json.loads((out / "results.json").read_text())["transfer"] and not list(out.glob("*.png"))


def test_import_makes_nothing_on_disk_and_the_disk_tier_makes_its_folder_when_first_needed(tmp_path):
    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system: the auto disk tier refuses it")
    home = tmp_path / "home"  # does not exist: offcache must not make it either
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCACHE_") and k != "XDG_CACHE_HOME"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, torch
        import offcache
        from offcache import engine as _engine
        folder = {str(home / ".cache" / "offcache")!r}
        assert _engine.settings()["disk_dir"] == folder, _engine.settings()
        print("after import", os.path.exists({str(home)!r}))
        offcache.configure(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit="2MiB")
        print("after configure", os.path.exists(folder))
        cache = offcache.IntermediatesCache.empty(4, "cpu")
        for i in range(4):
            cache.update(i, {{"x": torch.full((1 << 18,), float(i))}})
        print("after spilling", os.path.isdir(folder), oct(os.stat(folder).st_mode & 0o777))
        assert offcache.stats()["disk_bytes"] > 0
        assert all(bool((cache.fetch(i)["x"] == i).all()) for i in range(4))
    """)], env={**env, "HOME": str(home), "PYTHONPATH": str(ROOT)}, cwd=tmp_path, capture_output=True, text=True,
        timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["after import False", "after configure False", "after spilling True 0o700"]


@pytest.mark.parametrize("package", ["transformers", "llmcompressor", "compressed_tensors", "matplotlib"])
def test_every_public_module_imports_or_names_its_extra(tmp_path, package):
    """Each public module of offcache (and of offcache.bench), imported where one optional package is
    missing: it imports, or raises one ImportError whose message names the extra that installs it
    (issue 31 item 8: offcache.kv.dynamic used to raise the raw "No module named 'transformers'")."""
    proc = without((package,), """
        import importlib, pkgutil
        import offcache
        names = sorted(m.name for m in pkgutil.walk_packages(offcache.__path__, "offcache.")
                       if not m.name.rsplit(".", 1)[1].startswith("_"))
        for name in names:
            try:
                importlib.import_module(name)
                print("ok", name)
            except ImportError as exc:
                print("extra" if "pip install 'offcache[" in str(exc) else "RAW", name, type(exc).__name__, exc)
    """, tmp_path)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) > 10, proc.stdout + proc.stderr[-2000:]
    raw = [line for line in lines if line.startswith("RAW")]
    assert not raw, "\n".join(raw)
    assert any(line.startswith("ok offcache.activations.cache") for line in lines)
