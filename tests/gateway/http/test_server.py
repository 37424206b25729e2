"""The connection cap derived from the descriptor limit (issue 36): every limit gives a cap
that leaves descriptors for the reserve and an upstream connection per client connection,
or a start-up error naming the limit."""

from __future__ import annotations

import pytest

from gateway.http.server import DescriptorLimit, connection_cap


@pytest.mark.parametrize(("limit", "cap"), [
    (128, 32), (256, 96), (1024, 384), (4096, 1920), (65536, 32640)])
def test_the_derived_cap_leaves_a_reserve_and_an_upstream_descriptor_each(
    limit: int, cap: int,
) -> None:
    assert connection_cap(0, limit) == cap
    assert 2 * cap + 64 <= limit


def test_a_configured_cap_is_kept_below_what_the_limit_allows() -> None:
    assert connection_cap(8, 256) == 8
    assert connection_cap(10_000, 1024) == 384


@pytest.mark.parametrize("limit", [16, 100, 127])
def test_a_limit_too_low_to_serve_names_itself(limit: int) -> None:
    with pytest.raises(DescriptorLimit, match=rf"RLIMIT_NOFILE\) is {limit}: too low"):
        connection_cap(0, limit)
