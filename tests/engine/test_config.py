"""Configuration: every variable and configure() argument is range-checked in Python, by name."""

import pytest
import torch

import offcache
from offcache import engine as _engine
from offcache.engine import config as _config

GiB = 1 << 30


@pytest.mark.parametrize(
    "var, value, match",
    [
        # Past int64: used to reach pybind11 as "incompatible function arguments".
        ("OFFCACHE_HOST_COPY_DELAY_US", "99999999999999999999", "OFFCACHE_HOST_COPY_DELAY_US.*between 0 and"),
        ("OFFCACHE_HOST_COPY_DELAY_US", "-1", "OFFCACHE_HOST_COPY_DELAY_US"),
        ("OFFCACHE_HOST_COPY_DELAY_US", "1e3", "OFFCACHE_HOST_COPY_DELAY_US"),
        ("OFFCACHE_HOST_COPY_DELAY_US", "2.5", "OFFCACHE_HOST_COPY_DELAY_US"),
        ("OFFCACHE_HOST_COPY_DELAY_US", "true", "OFFCACHE_HOST_COPY_DELAY_US"),
        # Used to be capped at 1 GiB without a word.
        ("OFFCACHE_CHUNK_BYTES", "99999TiB", "OFFCACHE_CHUNK_BYTES.*between 1 and 1073741824 bytes"),
        ("OFFCACHE_CHUNK_BYTES", "2GiB", "OFFCACHE_CHUNK_BYTES.*1GiB"),
        # Used to mean 0 bytes.
        ("OFFCACHE_PINNED_LIMIT", "0.9", "OFFCACHE_PINNED_LIMIT.*fraction is not a size.*'90%'"),
        ("OFFCACHE_HOST_LIMIT", ".5", "OFFCACHE_HOST_LIMIT.*fraction is not a size.*'50%'"),
        ("OFFCACHE_MAX_IN_FLIGHT", "1.5", "OFFCACHE_MAX_IN_FLIGHT.*not a whole number of bytes"),
        ("OFFCACHE_PINNED_LIMIT", "17000000TiB", "OFFCACHE_PINNED_LIMIT.*2\\*\\*64"),
        ("OFFCACHE_PINNED_LIMIT", "nan%", "OFFCACHE_PINNED_LIMIT.*percentage"),
        ("OFFCACHE_PINNED_LIMIT", "inf", "OFFCACHE_PINNED_LIMIT"),
        ("OFFCACHE_PINNED_LIMIT", "1e9", "OFFCACHE_PINNED_LIMIT"),
        ("OFFCACHE_HOST_LIMIT", "-1GiB", "OFFCACHE_HOST_LIMIT"),
        ("OFFCACHE_BACKEND", "gpu", "OFFCACHE_BACKEND.*'auto', 'cuda' or 'host'"),
    ],
)
def test_bad_environment_values_name_the_variable(engine_config, monkeypatch, var, value, match):
    # engine_config first: its teardown (configure()) runs after monkeypatch restores the environment.
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        offcache.configure()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"host_copy_delay_us": True}, TypeError, r"host_copy_delay_us.*got True \(bool\)"),
        ({"host_copy_delay_us": 2**70}, ValueError, "host_copy_delay_us.*between 0 and"),
        ({"host_copy_delay_us": 1.0}, TypeError, "host_copy_delay_us"),
        ({"pinned_limit": "0.9"}, ValueError, "pinned_limit.*fraction is not a size.*'90%'.*bytes"),
        ({"pinned_limit": 0.9}, TypeError, "pinned_limit.*fraction is not a size.*'90%'"),
        ({"pinned_limit": False}, TypeError, "pinned_limit"),
        ({"pinned_limit": ""}, ValueError, "pinned_limit.*cannot read ''"),
        ({"pinned_limit": "   "}, ValueError, "pinned_limit"),
        ({"host_limit": "1.5 parsecs"}, ValueError, "host_limit"),
        ({"min_chunk": "99999TiB"}, ValueError, "min_chunk.*between 1 and 1073741824 bytes"),
        ({"min_chunk": 0}, ValueError, "min_chunk.*between 1 and"),
        ({"min_chunk": "50%"}, ValueError, "min_chunk.*between 1 and"),
        ({"max_in_flight": -1}, ValueError, "max_in_flight"),
        ({"backend": True}, ValueError, "backend"),
        ({"backend": ""}, ValueError, "backend"),
    ],
)
def test_bad_arguments_name_the_argument(engine_config, kwargs, error, match):
    with pytest.raises(error, match=match):
        offcache.configure(**kwargs)


def test_a_refused_configuration_keeps_the_working_engine(engine_config):
    engine_config(backend="host", pinned_limit="3MiB")
    with pytest.raises(ValueError):
        offcache.configure(backend="host", pinned_limit="3MiB", min_chunk="99999TiB")
    assert offcache.stats()["pinned_limit_bytes"] == 3 << 20


def test_edges_of_the_ranges_are_accepted(engine_config, monkeypatch):
    monkeypatch.setenv("OFFCACHE_CHUNK_BYTES", " 1GiB ")
    monkeypatch.setenv("OFFCACHE_HOST_COPY_DELAY_US", " 0 ")
    monkeypatch.setenv("OFFCACHE_PINNED_LIMIT", "1.5MiB")
    monkeypatch.setenv("OFFCACHE_BACKEND", " Host ")
    engine_config()
    assert offcache.stats()["pinned_limit_bytes"] == 3 << 19
    assert offcache.build_info()["backend"] == "host"
    engine_config(backend="host", min_chunk=1, host_copy_delay_us=_config._MAX_DELAY_US, max_in_flight=0)


def test_blank_variables_count_as_unset(engine_config, monkeypatch):
    monkeypatch.setenv("OFFCACHE_PINNED_LIMIT", "  ")
    monkeypatch.setenv("OFFCACHE_HOST_COPY_DELAY_US", "")
    engine_config(backend="host")
    assert offcache.stats()["pinned_limit_bytes"] == _engine.default_pinned_limit()


@pytest.mark.parametrize(
    "text, want",
    [("99999999999999999999", None), ("18446744073709551615", 2**64 - 1), ("0.5KiB", 512), ("1.5k", 1536),
     ("3.0", 3), ("7 MiB", 7 << 20)],
)  # fmt: skip
def test_sizes_are_exact(text, want):
    # Decimal arithmetic: no float rounding, so 2**64 - 1 is accepted and one more is refused.
    if want is None:
        with pytest.raises(ValueError, match="2\\*\\*64"):
            _engine.parse_size(text, "X")
    else:
        assert _engine.parse_size(text, "X") == want


def test_the_engine_refuses_a_smallest_chunk_past_the_largest(engine_config):
    """The compiled engine checks the range itself (Python's check is not the only guard):
    a smallest chunk above the 1 GiB largest would be undefined behaviour in the arena."""
    from offcache import _C

    with pytest.raises(ValueError, match=r"smallest chunk .* \[1, 1073741824\] bytes, got 2147483648"):
        _C.configure("host", 1 << 30, 2 << 30, 1 << 30, 0)
    (x,) = _engine.store([torch.arange(4.0)], torch.device("cpu"))  # the working engine stays
    _engine.wait_stored(x)  # a raw store's result is readable once its copy has landed
    assert torch.equal(x, torch.arange(4.0))
