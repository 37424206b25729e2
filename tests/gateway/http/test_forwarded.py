"""Who the client is, and what X-Forwarded-For says upstream."""

from __future__ import annotations

from gateway.http.forwarded import MAX_HOPS, Forwarding

XFF = b"x-forwarded-for"


def test_without_trusted_proxies_the_peer_is_the_client_whatever_it_claims() -> None:
    assert Forwarding([]).client("10.0.0.9", [(XFF, b"1.2.3.4")]) == ("10.0.0.9", b"10.0.0.9")


def test_an_untrusted_peer_is_the_client_even_when_others_are_trusted() -> None:
    forwarding = Forwarding(["10.1.0.0/16"])
    assert forwarding.client("10.0.0.9", [(XFF, b"1.2.3.4")]) == ("10.0.0.9", b"10.0.0.9")


def test_a_trusted_peer_appends_and_the_client_is_the_first_untrusted_from_the_right() -> None:
    forwarding = Forwarding(["10.1.0.0/16", "192.0.2.7"])
    headers = [(XFF, b"6.6.6.6, 1.2.3.4"), (XFF, b"192.0.2.7")]
    client, chain = forwarding.client("10.1.2.3", headers)
    assert client == "1.2.3.4"  # 6.6.6.6 is what 1.2.3.4 claimed: not believed
    assert chain == b"6.6.6.6, 1.2.3.4, 192.0.2.7, 10.1.2.3"


def test_garbage_in_the_chain_is_the_client_and_a_long_chain_is_cut() -> None:
    forwarding = Forwarding(["::1"])
    client, _ = forwarding.client("::1", [(XFF, b"1.2.3.4, not-an-ip")])
    assert client == "not-an-ip"
    long = ", ".join(f"10.0.0.{i}" for i in range(100)).encode()
    _, chain = forwarding.client("::1", [(XFF, long)])
    assert chain.count(b",") == MAX_HOPS  # the last MAX_HOPS hops and the peer
