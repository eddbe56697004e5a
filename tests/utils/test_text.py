"""num_held_back: what a streaming reader keeps back at the end of its text."""

from utils.text import num_held_back


def test_holds_the_longest_end_that_may_begin_a_prefix() -> None:
    assert num_held_back("hello <tool", ["<tool_call>"]) == 5
    assert num_held_back("a </th", ["</think>"]) == 4
    assert num_held_back("ends with <", ["<tool_call>", "</think>"]) == 1


def test_holds_nothing_when_no_prefix_can_follow() -> None:
    assert num_held_back("hello world", ["<tool_call>"]) == 0
    assert num_held_back("", ["STOP"]) == 0
    assert num_held_back("anything", []) == 0
    assert num_held_back("anything", [""]) == 0


def test_a_whole_prefix_is_left_to_the_caller() -> None:
    # The caller finds whole tags itself; only a proper beginning is held back.
    assert num_held_back("x STOP", ["STOP"]) == 0
    assert num_held_back("x STO", ["STOP"]) == 3


def test_the_longest_of_several_prefixes_wins() -> None:
    assert num_held_back("text ab", ["b!", "abc"]) == 2


def test_bytes_work_as_text_does() -> None:
    assert num_held_back(b"token sk-12", [b"sk-12345"]) == 5
