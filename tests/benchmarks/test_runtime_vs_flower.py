"""The runtime benchmark's command line offers what its help says."""

from __future__ import annotations

import pytest

from benchmarks.runtime_vs_flower import Plan, build_parser, make_plan


def _plan(*argv: str) -> Plan:
    return make_plan(build_parser().parse_args(list(argv)))


def test_tls_size_zero_means_no_mtls_row() -> None:
    """Its help offers `0: none`; it used to be refused ('sizes must be >= 1')."""

    def fedtrain_rows(*argv: str) -> list[str]:
        jobs = _plan("--sizes", "1M", "--flower-clients", "numpy", *argv).jobs
        return [j.variant for j in jobs if j.system == "fedtrain"]

    assert fedtrain_rows("--tls-size", "0") == ["insecure"]
    assert fedtrain_rows("--tls-size", "1M") == ["insecure", "mtls"]
    assert fedtrain_rows() == ["insecure", "mtls"]  # default: the largest side-by-side size


def test_sizes_still_refuse_zero_and_tls_size_refuses_negatives() -> None:
    parser = build_parser()
    for argv in (["--sizes", "0"], ["--tls-size", "-1"], ["--tls-size", "big"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
