import pytest

from extproc.policies.approx_prefix_index import ApproxPrefixIndex, leading_run, prompt_tokens
from extproc.request import RoutingRequest


def test_holders_and_lru_eviction_in_insertion_order():
    index = ApproxPrefixIndex(3)
    index.add([1, 2, 3], "a")
    index.add([1, 9], "b")
    assert index.holders(1) == {"a", "b"}
    index.add([4], "a")  # a's LRU holds 1, 2, 3: 1 is the least recent and goes
    assert index.holders(1) == {"b"} and index.holders(4) == {"a"} and index.size("a") == 3
    index.add([2], "a")  # touch 2: 3 is now the least recent
    index.add([5], "a")
    assert index.holders(3) == set() and index.holders(2) == {"a"}


def test_capacity_is_fixed_at_the_first_record():
    index = ApproxPrefixIndex(100)
    index.add([1, 2], "a", capacity=2)
    index.add([3, 4, 5], "a", capacity=50)
    assert index.capacity("a") == 2 and index.size("a") == 2
    index.add([1], "b", capacity=0)
    assert index.capacity("b") == 100


def test_match_counts_walks_while_any_endpoint_holds_the_key():
    index = ApproxPrefixIndex(10)
    index.add([1, 2, 3], "a")
    index.add([1, 3], "b")
    # key 2 is only at a, key 3 at both: b counts 1 and 3 (not a contiguous run of its own), as upstream
    assert index.match_counts([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.match_counts([7, 1]) == {}


def test_bad_capacity():
    with pytest.raises(ValueError):
        ApproxPrefixIndex(0)


@pytest.mark.parametrize("request_, expected", [
    (RoutingRequest("r", "POST", "/", block_keys=(1, 2, 3), prompt_token_ids=tuple(range(60))), 48),
    (RoutingRequest("r", "POST", "/", prompt_token_ids=tuple(range(60))), 60),
    (RoutingRequest("r", "POST", "/", prompt_text="x" * 41), 10),
    (RoutingRequest("r", "POST", "/"), 0),
])
def test_prompt_tokens(request_, expected):
    assert prompt_tokens(request_, 16) == expected


@pytest.mark.parametrize("held, expected", [(set(), 0), ({1}, 1), ({1, 2, 3}, 3), ({1, 2, 3, 4, 5}, 5),
                                            ({1, 2, 3, 4, 5, 99}, 5)])
def test_leading_run_of_a_set_of_whole_prefixes(held, expected):
    assert leading_run((1, 2, 3, 4, 5), held) == expected
    assert leading_run((), held) == 0
