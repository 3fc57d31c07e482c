"""EarlyReleases: which late Admits are not counted, for how long, and how many ids are kept."""

from predictor.early_releases import EarlyReleases


def test_a_late_admit_is_caught_once_within_the_ttl():
    early = EarlyReleases(ttl_s=30.0)
    early.release("a", now_s=100.0)
    assert not early.admit_came_late("b", now_s=101.0)  # never released
    assert early.admit_came_late("a", now_s=129.0)
    assert not early.admit_came_late("a", now_s=129.5)  # forgotten once caught
    assert early.num_ignored_admits == 1
    early.release("c", now_s=200.0)
    assert not early.admit_came_late("c", now_s=230.5)  # past the TTL: counted as usual
    assert len(early) == 0


def test_at_most_max_ids_are_kept_oldest_forgotten_first():
    early = EarlyReleases(ttl_s=30.0, max_ids=2)
    for i, request_id in enumerate("abc"):
        early.release(request_id, now_s=float(i))
    assert len(early) == 2
    assert not early.admit_came_late("a", now_s=3.0)
    assert early.admit_came_late("b", now_s=3.0) and early.admit_came_late("c", now_s=3.0)
    early.release("d", now_s=10.0)
    early.release("e", now_s=11.0)
    early.release("d", now_s=12.0)  # released again: its time and place move to the newest
    early.release("f", now_s=13.0)
    assert not early.admit_came_late("e", now_s=14.0) and early.admit_came_late("d", now_s=14.0)
