"""server.memory.Trimmer: freed heap pages back to the OS at most every `every_s` seconds,
on the worker thread (a 30-minute soak's RSS creep was glibc keeping freed pages resident)."""

from server.memory import Trimmer, _glibc_trim


def test_trims_at_most_every_interval():
    now = [0.0]
    calls = []
    t = Trimmer(every_s=10.0, trim=lambda pad: calls.append(pad) or 1, clock=lambda: now[0])
    assert not t.maybe()                 # (the interval starts at construction)
    now[0] = 9.9
    assert not t.maybe() and calls == []
    now[0] = 10.0
    assert t.maybe() and calls == [0]
    now[0] = 15.0
    assert not t.maybe()
    now[0] = 20.5
    assert t.maybe() and t.trims == 2 and calls == [0, 0]


def test_without_glibc_it_does_nothing():
    t = Trimmer(every_s=0.0, trim=None)
    t.trim = None
    assert not t.maybe() and t.trims == 0


def test_glibc_trim_is_found_here_and_callable():
    fn = _glibc_trim()                   # (this machine and CI run glibc Linux)
    assert fn is not None and fn(0) in (0, 1)


def test_the_gateway_trims_on_its_worker():
    from server.gateway import Gateway
    g = Gateway()
    assert isinstance(g._trimmer, Trimmer) and g._trimmer.every_s <= 30
