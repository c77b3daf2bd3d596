"""The Poisson load generator offers the rate it is asked for (on loopback, no root)."""
import socket

from datapath import client, wire


def pair():
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.settimeout(1)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.connect(sink.getsockname())
    return sink, tx


def test_offered_rate_is_the_asked_rate():
    sink, tx = pair()
    try:
        pkts = client.request_packets(1, 1, 1, [1, 2, 3])
        for seed in (1, 2):   # a small seed once gave far too long first gaps
            res = client.send(tx, pkts, rate=5000, count=2000, duration=5, drain_ms=0, seed=seed)
            assert res["sent"] == 2000
            assert 0.85 * 5000 < res["offered_pps"] < 1.15 * 5000, res["offered_pps"]
    finally:
        sink.close(), tx.close()


def test_request_ids_continue_from_seq_base():
    sink, tx = pair()
    try:
        res = client.send(tx, client.request_packets(1, 1, 1, [1]), rate=20000, count=50, duration=5,
                          drain_ms=0, seq_base=7_000_000)
        assert res["sent"] == 50
        ids = [wire.decode_request(sink.recv(2048)).request_id for _ in range(50)]
        assert sorted(ids) == list(range(7_000_000, 7_000_050))
    finally:
        sink.close(), tx.close()


def test_sequence_ids_refuse_requests_of_several_chunks():
    import pytest
    sink, tx = pair()
    try:
        with pytest.raises(ValueError, match="one-chunk requests"):
            client.send(tx, client.request_packets(1, 1, 1, range(300)), rate=1000, count=3, duration=1)
    finally:
        sink.close(), tx.close()
