"""Math and countdown rewards: correctness, partial credit, counted failures."""

from __future__ import annotations

import threading
import time

import pytest

from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import (
    MAX_BOXED_CHARS,
    MathReward,
    canonical_answer,
    extract_boxed,
    last_number,
    quantity,
)
from roll_envs.tasks.countdown import CountdownReward, evaluate_equation


def test_extract_boxed_takes_the_last_balanced_box() -> None:
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{unbalanced") is None


def test_a_trailing_empty_box_does_not_hide_the_answer() -> None:
    """A reply that repeats the prompt's "\\boxed{}" after answering still answered (the last non-empty box);
    only empty boxes are no answer, and a truncated last box is still none."""
    assert extract_boxed(r"\boxed{42} Format: \boxed{}") == "42"
    assert extract_boxed(r"\boxed{} and \boxed{ }") == ""
    assert extract_boxed(r"\boxed{1} then \boxed{2") is None
    res = MathReward(format_weight=0.1).score([r"So \boxed{42}. (Answer format: \boxed{})"], ["42"])
    assert res.correct == [1.0] and res.formatted == [1.0] and res.counters["no_boxed"] == 0


def test_plain_numbers_compare_exactly_with_thousands_separators() -> None:
    """1,000 is 1000 on either side; integers beyond 2^53 are compared exactly (a float made ...662 equal to
    ...661); decimals keep a 1e-9 tolerance."""
    reward = MathReward(last_number_weight=0.5)
    pairs = [
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{1000}", "1,000", 1.0),
        (r"\boxed{-1,234,567}", "-1234567", 1.0),
        (r"\boxed{3,000}", "3,000.0", 1.0),
        (r"\boxed{469401340152858662}", "469401340152858661", 0.0),
        (r"\boxed{100000000000000000001}", "100000000000000000000", 0.0),
        (r"\boxed{469401340152858661}", "469401340152858661", 1.0),
        (r"\boxed{0.5}", "0.50", 1.0),
    ]
    res = reward.score([r for r, _, _ in pairs], [a for _, a, _ in pairs])
    assert res.correct == [c for _, _, c in pairs]
    assert reward.score(["it is 1,000 then"], ["1,000"]).scores == [0.5]  # last-number credit, both sides
    # spaces between thousands groups (plain or LaTeX thin) are separators; other spaces are not: 1 2 is not 12
    spaced = [r"\boxed{1 000}", r"\boxed{1\,000}", r"\boxed{12 345 678}", r"\boxed{1 2}"]
    assert reward.score(spaced, ["1000", "1000", "12345678", "12"]).correct == [1.0, 1.0, 1.0, 0.0]


def test_last_number() -> None:
    assert last_number("pages 10-12") == "12" and last_number("x-3") == "3"  # a hyphen or operator, not a sign
    assert last_number("so x = -5") == "-5" and last_number("3-4=-1") == "-1"
    assert last_number("3 + 4 = 7, so 7.") == "7"
    assert last_number("it is 1,234") == "1234"
    assert last_number("none") is None
    # parts of fractions, powers and indices are not numbers the response states
    assert last_number("So x = 3/2.") is None and last_number(r"\frac{1}{2}") is None
    assert last_number("2^{10}") is None and last_number("x_2 = 5") == "5" and last_number("7 then x^2") == "7"


def test_a_wrong_boxed_answer_earns_no_last_number_credit() -> None:
    """The credit is for a right number stated without a box: a wrong boxed answer ending in the truth's digits
    (a reciprocal, a power, a root) is wrong, and so is a fraction whose denominator is the truth."""
    reward = MathReward(last_number_weight=0.5)
    cases = [r"\boxed{\frac{1}{2}}", r"\boxed{2^{10}}", r"\boxed{\sqrt{2}}", "So x = 3/2.", r"\boxed{5}, i.e. 2"]
    res = reward.score(cases, ["2"] * len(cases))
    assert res.scores == [0.0] * len(cases) and res.correct == [0.0] * len(cases)
    assert reward.score(["so it is 2"], ["2"]).scores == [0.5]


def test_math_reward_scores_and_counts() -> None:
    reward = MathReward(last_number_weight=0.5, format_weight=0.1)
    res = reward.score(
        [r"The sum is \boxed{12}.", r"\boxed{\frac{24}{2}}", "3 + 9 = 12", r"\boxed{13}", "I don't know"],
        ["12", "12", "12", "12", "12"],
    )
    # boxed right: 1 + 0.1; latex-equivalent right: 1.1; unboxed right number: 0.5; boxed wrong: 0.1; nothing: 0
    assert res.scores == pytest.approx([1.1, 1.1, 0.5, 0.1, 0.0])
    assert res.correct == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert res.formatted == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert res.counters["no_boxed"] == 2


def test_math_reward_grades_only_the_answer_after_the_reasoning() -> None:
    """A thinking model's box (or number) inside its `<think>` block is no answer: a reply cut off while reasoning
    has none (it was graded right on a box from its reasoning), and one that boxes the truth only while reasoning
    then answers wrong is wrong (right, when its reasoning's box came last). Without think tags: read whole."""
    reward = MathReward(last_number_weight=0.5, format_weight=0.1)
    cut = r"<think>Maybe \boxed{42}, let me check 6*7 = 42 and"
    boxed_in_reasoning = r"<think>so \boxed{42}?</think>The answer is 41."
    right = r"<think>try \boxed{41}... no.</think>The answer is \boxed{42}."
    unboxed = r"<think>\boxed{41}?</think> It is 42"
    plain = r"First \boxed{41}, then \boxed{42}"
    res = reward.score([cut, boxed_in_reasoning, right, unboxed, plain], ["42"] * 5)
    assert res.scores == pytest.approx([0.0, 0.0, 1.1, 0.5, 1.1])
    assert res.correct == [0.0, 0.0, 1.0, 0.0, 1.0] and res.formatted == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert res.counters["no_boxed"] == 3
    # roll-eval's majority vote reads the same answer.
    assert [reward.extract_answer(r) for r in (cut, boxed_in_reasoning, right, plain)] == [None, None, "42", "42"]


def test_majority_vote_counts_one_value_written_several_ways_once() -> None:
    """roll-eval's maj@n votes on `extract_answer`: samples boxing 1,000 / 1000 / 1000.0 / 1 000 agree (the reward
    grades each right), so they outvote two wrong 999s; as raw boxed strings they split and 999 won."""
    from roll_core.eval_metrics import summarize

    reward = MathReward()
    boxed = ["1,000", "999", "1000", "999", "1000.0", "1 000"]
    responses = [f"so \\boxed{{{b}}}" for b in boxed]
    res = reward.score(responses, ["1000"] * len(boxed))
    assert res.correct == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    rows = [
        {"index": 0, "sample": j, "correct": c, "reward": c, "length": 1, "finish_reason": "stop", "formatted": 1.0}
        | {"extracted": reward.extract_answer(r)}
        for j, (r, c) in enumerate(zip(responses, res.correct))
    ]
    assert summarize(rows, [1])["maj"] == 1.0
    assert [reward.extract_answer(r) for r in responses] == ["1000", "999", "1000", "999", "1000", "1000"]
    same = [r"\boxed{\dfrac{1}{2}}", r"\boxed{\tfrac{1}{2}}", r"\boxed{\frac{1}{2}}", r"\boxed{0.50}", r"\boxed{-0.5}"]
    assert [reward.extract_answer(r) for r in same] == ["0.5"] * 4 + ["-0.5"]
    assert reward.extract_answer("no box") is None and reward.extract_answer(r"\boxed{x+1}") == "x+1"
    assert reward.extract_answer(r"\boxed{\dfrac{\pi}{2}}") == r"\frac{\pi}{2}"


def test_majority_vote_groups_fractions_decimals_and_units_the_grader_equates() -> None:
    """\\frac{1}{2}, 1/2 and 0.5 are one answer to the grader, so they vote together and outvote two wrong 3s (as
    three keys, 3 won maj@n); 2/6 and \\frac{1}{3} share a key, \\$1,000 and 1000 dollars too; 75% keeps its own
    key (the grader equates it with 75 and with 0.75, which differ)."""
    from roll_core.eval_metrics import summarize

    reward = MathReward()
    boxed = [r"\frac{1}{2}", "3", "0.5", "3", "1/2"]
    responses = [f"so \\boxed{{{b}}}" for b in boxed]
    res = reward.score(responses, ["0.5"] * len(boxed))
    assert res.correct == [1.0, 0.0, 1.0, 0.0, 1.0]
    rows = [
        {"index": 0, "sample": j, "correct": c, "reward": c, "length": 1, "finish_reason": "stop", "formatted": 1.0}
        | {"extracted": reward.extract_answer(r)}
        for j, (r, c) in enumerate(zip(responses, res.correct))
    ]
    assert summarize(rows, [1])["maj"] == 1.0
    keys = [r"\boxed{2/6}", r"\boxed{\frac{1}{3}}", r"\boxed{\$1,000}", r"\boxed{1000 dollars}", r"\boxed{75\%}"]
    assert [reward.extract_answer(r) for r in keys] == [r"\frac{1}{3}"] * 2 + ["1000"] * 2 + ["75%"]
    assert [reward.extract_answer(r) for r in [r"\boxed{-\frac{3}{2}}", r"\boxed{\tfrac{-6}{4}}"]] == ["-1.5"] * 2


def test_majority_vote_merges_answers_only_the_symbolic_check_equates() -> None:
    """\\frac{\\sqrt{2}}{2}, \\frac{1}{\\sqrt2} and \\sqrt{2}/2 are three keys (no spelling unites them) but one
    answer to the grader: with the reward's `same_answer` (what roll-eval passes) they vote together and outvote two
    wrong 1s (by key alone, 1 won maj@n). Quantities compare by key (75% stays apart from 75 and 0.75); a clear
    majority costs no symbolic check."""
    from types import SimpleNamespace

    from roll_core.eval_metrics import majority_vote, summarize
    from roll_core.evaluate import answer_equivalence

    reward = MathReward()
    boxed = [r"\frac{\sqrt{2}}{2}", "1", r"\frac{1}{\sqrt2}", "1", r"\sqrt{2}/2"]
    responses = [f"so \\boxed{{{b}}}" for b in boxed]
    res = reward.score(responses, [r"\frac{\sqrt{2}}{2}"] * len(boxed))
    assert res.correct == [1.0, 0.0, 1.0, 0.0, 1.0]
    rows = [
        {"index": 0, "sample": j, "correct": c, "reward": c, "length": 1, "finish_reason": "stop", "formatted": 1.0}
        | {"extracted": reward.extract_answer(r)}
        for j, (r, c) in enumerate(zip(responses, res.correct))
    ]
    assert summarize(rows, [1])["maj"] == 0.0  # by key: 1 has two votes, each root spelling one
    same = answer_equivalence(SimpleNamespace(reward=reward))  # the reward's, as roll-eval finds it
    assert same is not None and summarize(rows, [1], same)["maj"] == 1.0
    assert majority_vote([r["extracted"] for r in rows], same) == (r"\frac{\sqrt{2}}{2}", 0)
    assert reward.same_answer("0.5", ".5") and reward.same_answer("2", "x=2")
    assert not reward.same_answer("75%", "0.75") and not reward.same_answer("75", "75%")
    assert not reward.same_answer("1", r"\frac{1}{\sqrt2}") and not reward.same_answer("x+1", "x+2")
    calls: list[tuple[str, str]] = []
    counted = lambda a, b: calls.append((a, b)) or reward.same_answer(a, b)
    assert majority_vote(["2", "2", "2", r"\sqrt{4}", "x=2"], counted) == ("2", 0) and calls == []


def test_units_currency_and_percent_are_graded_by_value() -> None:
    """A number with a unit, a currency sign or a percent sign is graded by its value (the Qwen-math and
    math-verify conventions): 1000 dollars is 1000 (math-verify knew no "dollars": wrong), 75\\% is 75 and 0.75
    (math-verify: 75% right against 0.75, 75\\% wrong; 7.5% wrong against 7.5). A unit never hides a second
    number or a variable."""
    reward = MathReward()
    right = [
        ("1000 dollars", "1000"),
        ("1000", "1000 dollars"),
        (r"\$1,000.00", "1000"),
        (r"1000\text{ dollars}", r"\$1000"),
        ("3 cats", "3"),
        ("12 square feet", "12"),
        (r"75\%", "75"),
        (r"75\%", "0.75"),
        ("0.75", r"75\%"),
        ("7.5%", "7.5"),
        ("75 percent", "0.75"),
        (r"\frac{3}{4}", r"75\%"),
        (r"-\$5", "-5"),
        (r"10^{\circ}", "10"),
    ]
    wrong = [
        ("1000 dollars and 5", "1000"),
        (r"1000\text{ dollars and }5", "1000"),
        (r"75\%", "7.5"),
        ("0.75%", r"75\%"),
        ("75", "0.75"),
        ("5 x", "5"),
        ("5xy", "5"),
        ("5 pi", "5"),
        ("5 times 2", "5"),
        ("2^{10}", "2"),
    ]
    cases = right + wrong
    res = reward.score([f"\\boxed{{{b}}}" for b, _ in cases], [a for _, a in cases])
    assert res.correct == [1.0] * len(right) + [0.0] * len(wrong), list(zip(cases, res.correct))
    assert res.counters["errors"] == res.counters["timeouts"] == 0
    # the last-number credit reads the truth the same way (a truth of \\$1,000 gave no credit for "1000")
    unboxed = MathReward(last_number_weight=0.5).score(
        ["it costs 1000", "so 75", "so 0.75", "so 7"], [r"\$1,000", r"75\%", r"75\%", "7 days"]
    )
    assert unboxed.scores == [0.5] * 4


def test_numbers_too_long_for_int_are_compared_as_text() -> None:
    """Python's int() refuses more than 4300 digits: a plain number that long is compared as text (not refused by
    length, not a crash), and its vote key is the text (extract_answer raised ValueError on it)."""
    huge = "9" * 10_000
    reward = MathReward(last_number_weight=0.5)
    res = reward.score([f"\\boxed{{{huge}}}", f"\\boxed{{{huge}}}", f"it is {huge}"], [huge, "7", huge])
    assert res.scores == [1.0, 0.0, 0.5] and res.counters["errors"] == 0
    assert reward.extract_answer(f"\\boxed{{{huge}}}") == huge


def test_empty_box_earns_no_format_bonus() -> None:
    res = MathReward(format_weight=0.2, last_number_weight=0.5).score(
        [r"The answer is \boxed{} 7", r"\boxed{}"], ["7", "7"]
    )
    assert res.scores == [0.5, 0.0] and res.formatted == [0.0, 0.0]


def test_math_reward_strict_by_default() -> None:
    res = MathReward().score(["7", r"\boxed{7}"], ["7", "7"])
    assert res.scores == [0.0, 1.0]


def test_math_reward_counts_parse_failures_instead_of_raising() -> None:
    """A malformed box math-verify cannot read is a wrong answer (math-verify returns no parse, no crash); a box
    longer than MAX_BOXED_CHARS is refused unverified and counted as an error."""
    long_box = "\\boxed{" + "x+" * (MAX_BOXED_CHARS // 2 + 1) + "1}"
    res = MathReward().score([r"\boxed{\frac{1}{}}+++}", long_box], ["1/2", "1/2"])
    assert res.scores == [0.0, 0.0] and res.correct == [0.0, 0.0]
    assert res.counters == {"timeouts": 0, "errors": 1, "no_boxed": 0, "bad_answers": 0}


def test_a_box_of_empty_boxes_is_empty() -> None:
    """`\\boxed{\\boxed{}}` states no answer: it was read as the answer `\\boxed{}` and earned the format bonus."""
    assert extract_boxed(r"\boxed{\boxed{}}") == ""
    assert extract_boxed(r"\boxed{ \boxed{ \fbox{} } }") == ""
    assert extract_boxed(r"\boxed{7} then \boxed{\boxed{}}") == "7"
    assert extract_boxed(r"\boxed{\boxed{5}}") == "5"
    assert extract_boxed(r"\boxed{\{\}}") == r"\{\}"  # the empty set is an answer
    res = MathReward(format_weight=0.1, last_number_weight=0.5).score(
        [r"\boxed{\boxed{}} so 7", r"\boxed{\boxed{}}"], ["7", "7"]
    )
    assert res.scores == [0.5, 0.0] and res.formatted == [0.0, 0.0] and res.counters["no_boxed"] == 2


def test_a_brace_less_last_box_is_the_answer() -> None:
    """`\\boxed 5` (as MATH's `last_boxed_only_string` reads it) was no answer, so a right one scored 0, and in
    `\\boxed{2} ... \\boxed 5` the earlier 2 was graded: right against a truth of 2 for a final answer of 5."""
    assert extract_boxed(r"so the answer is \boxed 5") == "5"
    assert extract_boxed(r"\boxed{2} ... so the final answer is \boxed 5") == "5"
    assert extract_boxed(r"\boxed 5 ... no, \boxed{2}") == "2"  # the last box, whatever its form
    assert extract_boxed(r"it is $\boxed 5$, so") == "5" and extract_boxed(r"It is \boxed 5.") == "5"
    assert extract_boxed(r"$\boxed \frac{1}{2}$") == r"\frac{1}{2}" and extract_boxed(r"\boxed{\boxed 7}") == "7"
    assert extract_boxed(r"\boxed 5!") == "5!"  # a factorial, not punctuation
    assert extract_boxed(r"\boxed 3 then \boxed{}") == "3" and extract_boxed(r"\fbox{4}") == "4"
    assert extract_boxed(r"\boxedx") is None and extract_boxed(r"\boxed $") is None  # no box
    res = MathReward(format_weight=0.1).score(
        [r"so \boxed 5", r"\boxed{2} ... so the final answer is \boxed 5"], ["5", "2"]
    )
    assert res.correct == [1.0, 0.0] and res.scores == [1.1, 0.1] and res.formatted == [1.0, 1.0]


def test_escaped_braces_do_not_count_toward_balance() -> None:
    """`\\{` and `\\}` are characters of the answer: `\\boxed{\\left\\{x\\right.}` read as unbalanced (no answer),
    and `\\right\\}}` closed the box one brace early."""
    assert extract_boxed(r"\boxed{\left\{x\right.}") == r"\left\{x\right."
    assert extract_boxed(r"\boxed{\left. x \right\}} done") == r"\left. x \right\}"
    assert extract_boxed(r"\boxed{a \\ {b}}") == r"a \\ {b}"  # `\\` is a line break; the brace after it is real
    assert extract_boxed(r"\boxed{\}") is None  # only an escaped brace: the box never closes
    res = MathReward(format_weight=0.1).score([r"So \boxed{\left\{x\right.}", r"\boxed{1} \boxed{\{1,2}"], ["1", "1"])
    assert res.formatted == [1.0, 1.0] and res.correct == [0.0, 0.0] and res.counters["no_boxed"] == 0


def test_last_number_reads_exponents_and_only_thousands_grouping() -> None:
    """`1.5e3` was read as 3 (the exponent) and `1,2345` as 5; now 1.5e3 is 1500, and commas that are no thousands
    grouping (`1,2345`, a decimal comma `1,5`, a list `1,2,3`) state no one number: None."""
    assert last_number("it is 1.5e3") == "1.5e3" and last_number("so 2E-3.") == "2E-3"
    assert last_number("x = -1e5") == "-1e5"
    assert last_number("it is 1,2345") is None and last_number("about 1,5") is None
    assert last_number("1,2,3") is None and last_number("1, 2, 3") == "3"
    assert last_number("it is 1,234,567") == "1234567" and last_number("12,345.5 m") == "12345.5"
    reward = MathReward(last_number_weight=0.5)
    res = reward.score(
        ["it is 1.5e3", "it is 1,2345", "it is 1,2345", "it is 1e99999", "it is 1e-5"],
        ["1500", "5", "12345", "5", "0.00001"],
    )
    assert res.scores == [0.5, 0.0, 0.0, 0.0, 0.5]


def test_words_that_change_the_value_are_not_units() -> None:
    """`5 squared`, `5 halves`, `5 dozen` are not 5 with a unit: they were graded right against a truth of 5 (and
    wrong against 25) and voted with 5. (Scale words multiply the value: test_scale_words_multiply_the_number.)"""
    reward = MathReward()
    changed = ["5 dozen", "5 squared", "5 cubed", "5 factorial", "5 halves", "5 hundredths", "5 less"]
    for text in changed:
        assert quantity(text) is None, text
    graded = changed[:-1]  # math-verify itself reads `5 less` (like `5 or more`) as 5
    res = reward.score([f"\\boxed{{{t}}}" for t in graded] + [r"\boxed{5 cubic feet}"], ["5"] * (len(graded) + 1))
    assert res.correct == [0.0] * len(graded) + [1.0]
    assert reward.extract_answer(r"\boxed{5 squared}") == "5 squared"


#: (truth, boxed answer, correct): a scale word multiplies the number in the truth and the answer alike, and a
#: scaled answer is never the unscaled number. The old grader scored `5\text{ million}` right against 5 and wrong
#: against 5000000, and a bare `5 million` right only against itself.
SCALE_CASES = [
    (r"5\text{ million}", "5", 0.0),
    (r"5\text{ million}", r"5\text{ million}", 1.0),
    (r"5\text{ million}", "5000000", 1.0),
    (r"5\text{ million}", "5,000,000", 1.0),
    (r"5\text{ million}", "5 million", 1.0),
    ("5 million", "5", 0.0),
    ("5 million", "5000000", 1.0),
    ("5 million", r"5\text{ million}", 1.0),
    ("5 million", r"5\mbox{ Million}", 1.0),
    ("5 million", r"5\mathrm{millions}", 1.0),
    ("5 million", "5 million", 1.0),
    ("5000000", r"5\text{ million}", 1.0),
    ("5000000", "5 million", 1.0),
    ("5000000", "5 Millions", 1.0),
    ("5,000,000", r"\$5 million", 1.0),
    ("5000000", r"5\text{ million dollars}", 1.0),
    ("5000000", "5 million dollars", 1.0),
    ("5000000", "5", 0.0),
    ("5", r"5\text{ million}", 0.0),
    ("5", "5 million", 0.0),
    ("5", r"5\mbox{ thousand}", 0.0),
    ("5", "5", 1.0),
    ("1500000000", r"1.5\text{ billion}", 1.0),
    ("3000000000000", r"\frac{3}{1}\text{ trillion}", 1.0),
    ("2500", "2.5 thousand", 1.0),
    ("2.5", "2.5 thousand", 0.0),
    # not a quantity: the scale word reaches math-verify as a power of ten, never dropped with its \text{}
    ("x = 5000000", r"x = 5\text{ million}", 1.0),
    ("5", r"x = 5\text{ million}", 0.0),
    (r"\sqrt{2}", r"\sqrt{2}\text{ million}", 0.0),
    (r"1000000\sqrt{2}", r"\sqrt{2}\text{ million}", 1.0),
    # percent is unchanged: its number or its hundredth
    (r"75\%", "75", 1.0),
    (r"75\%", "0.75", 1.0),
    ("0.75", r"75\%", 1.0),
    ("75", "75 percent", 1.0),
    # units keep working
    ("1000", r"1000\text{ dollars}", 1.0),
    ("5", "5 cubic feet", 1.0),
]


@pytest.mark.parametrize(("truth", "answer", "expected"), SCALE_CASES)
def test_scale_words_multiply_the_number(truth: str, answer: str, expected: float) -> None:
    """One convention for scale words, in both directions and in the majority vote: equal values share a vote key
    (and `same_answer`), a scaled answer and its unscaled number do neither."""
    reward = MathReward()
    res = reward.score([f"so \\boxed{{{answer}}}"], [truth])
    assert res.correct == [expected] and res.counters["errors"] == res.counters["timeouts"] == 0
    one_percent = any(p in truth for p in ("%", "percent")) != any(p in answer for p in ("%", "percent"))
    vote = bool(expected) and not one_percent  # the vote keeps 75% apart from 75 and 0.75 (module docstring)
    key_truth, key_answer = canonical_answer(truth), canonical_answer(answer)
    assert reward.same_answer(key_truth, key_answer) == vote
    if quantity(truth) is not None and quantity(answer) is not None:
        assert (key_truth == key_answer) == vote


def test_scale_word_quantities_and_stated_numbers() -> None:
    """The values read, their vote keys, and the last-number credit: an unboxed `5 million` states 5000000."""
    assert quantity("5 million") == (5_000_000, False) and quantity(r"5\text{ million}") == (5_000_000, False)
    assert quantity(r"\$1.5\,\text{Billion}") == (1_500_000_000, False) and quantity("2 hundred") == (200, False)
    assert quantity("5 million.") == (5_000_000, False) and quantity("5 millionaires") == (5, False)  # a unit
    # a scaled percent, a second scale word, a scale word after a unit or a stray brace: no quantity
    for text in ["5 million%", "5 million percent", "5 million million", "5 dollars million", "5 million}"]:
        assert quantity(text) is None, text
    assert canonical_answer("5 million") == canonical_answer(r"5\text{ million}") == "5000000"
    assert last_number("it is 5 million") == "5000000" and last_number(r"so 1.5\text{ thousand} m") == "1500"
    reward = MathReward(last_number_weight=0.5)
    stated = ["it is 5 million", "it is 5 million", "it is 5000000", "it is 5"]
    res = reward.score(stated, ["5", "5000000", r"5\text{ million}", "5 million"])
    assert res.scores == [0.0, 0.5, 0.5, 0.0]


def _graded_and_voted(truth: str, answer: str, expected: float) -> None:
    """`answer` boxed is graded `expected` against `truth` (no errors, no timeouts); the majority vote agrees: equal
    answers share `same_answer`, and equal quantities their vote key."""
    reward = MathReward()
    res = reward.score([f"so \\boxed{{{answer}}}"], [truth])
    assert res.correct == [expected] and res.counters["errors"] == res.counters["timeouts"] == 0
    key_truth, key_answer = canonical_answer(truth), canonical_answer(answer)
    assert reward.same_answer(key_truth, key_answer) == bool(expected)
    if quantity(truth) is not None and quantity(answer) is not None:
        assert (key_truth == key_answer) == bool(expected)


#: (truth, boxed answer, correct): words that change the value inside `\text{}`/`\mbox{}`/`\mathrm{}` grade as the
#: bare words do, never as the number. math-verify dropped the text command: the old grader scored `5\text{ dozen}`
#: right against 5 (and `5 squared` wrong against `5\text{ squared}`), and `\text{5 dollars}` wrong against 5.
VALUE_WORD_CASES = [
    ("5", r"5\text{ squared}", 0.0),
    ("5", r"5\text{ dozen}", 0.0),
    ("5", r"5\text{ halves}", 0.0),
    ("5", r"5\mbox{ factorial}", 0.0),
    ("5", r"5\mathrm{cubed}", 0.0),
    ("5", r"5\textbf{ thirds}", 0.0),
    ("5", r"5\text{ and a half}", 0.0),
    ("5", r"x = 5\text{ dozen}", 0.0),
    (r"5\text{ squared}", "5", 0.0),
    ("5 squared", r"5\text{ squared}", 1.0),
    (r"5\text{ squared}", "5 squared", 1.0),
    (r"5\text{ squared}", r"5\text{ squared}", 1.0),
    ("5", "5 squared", 0.0),
    ("5", "5 dozen", 0.0),
    ("5", r"\text{5 squared}", 0.0),
    # genuine units keep working, in a text command or wholly inside one
    ("5", r"5\text{ cm}", 1.0),
    ("5", r"5\text{ apples}", 1.0),
    ("5", r"5\text{ times}", 1.0),
    ("5", r"\text{5 dollars}", 1.0),
    (r"\text{5 dollars}", "5", 1.0),
    (r"\text{5}", "5", 1.0),
    ("6", r"\text{5 dollars}", 0.0),
    # `squared`/`cubed` after a unit word raise the unit, bare or in a text command
    ("5", r"5\text{ cm squared}", 1.0),
    ("5", "5 cm squared", 1.0),
    ("5", r"5\text{ feet cubed}", 1.0),
]


@pytest.mark.parametrize(("truth", "answer", "expected"), VALUE_WORD_CASES)
def test_value_words_in_text_commands_are_not_units(truth: str, answer: str, expected: float) -> None:
    r"""`5\text{ squared}` grades as `5 squared` does: never as the bare number 5."""
    _graded_and_voted(truth, answer, expected)


#: (truth, boxed answer, correct): LaTeX thousands separators read as `5,000` and `5 000` do. The old grader read
#: `5{,}000`, `5\!000` and `5\!,\!000` as no quantity (the vote kept them apart from 5000) and last_number read
#: `5{,}000` as 000. A comma that is no thousands separator stays one (`1{,}5` is not 1.5, `5, 000` not 5000),
#: and a tuple stays a tuple.
SEPARATOR_CASES = [
    ("5000", r"5{,}000", 1.0),
    (r"5{,}000", "5000", 1.0),
    ("5,000", r"5{,}000", 1.0),
    ("5000000", r"5{,}000{,}000", 1.0),
    ("5000", r"\$5{,}000", 1.0),
    ("5000", r"5{,}000\text{ dollars}", 1.0),
    ("5000", r"5\!,\!000", 1.0),
    ("5000", r"5\!000", 1.0),
    (r"5\!000", "5000", 1.0),
    ("5000", r"5\,000", 1.0),
    ("5", r"5{,}000", 0.0),
    ("1.5", r"1{,}5", 0.0),
    ("15", r"1{,}5", 0.0),
    ("5000", "5, 000", 0.0),
    ("(5, 000)", r"(5{,}000)", 1.0),
    ("5000", r"(5{,}000)", 0.0),
]


@pytest.mark.parametrize(("truth", "answer", "expected"), SEPARATOR_CASES)
def test_latex_thousands_separators(truth: str, answer: str, expected: float) -> None:
    r"""`5{,}000`, `5\,000` and `5\!000` are 5000, both ways round, and vote as 5000 (one key, not `5{,}000`)."""
    _graded_and_voted(truth, answer, expected)
    if expected and not truth.startswith("("):
        assert canonical_answer(truth) == canonical_answer(answer) == canonical_answer(truth.replace("{,}", ","))


def test_latex_thousands_separators_in_stated_numbers() -> None:
    """The last-number credit reads LaTeX separators as `quantity` does (it read `5{,}000` as 000); a plain space in
    prose is still no separator, and a LaTeX comma no thousands grouping states no number, as `1,2345` does not."""
    assert last_number(r"it is 5{,}000") == last_number(r"it is 5\,000") == last_number(r"it is 5\!000") == "5000"
    assert last_number(r"so 5{,}000{,}000 of them") == "5000000" and last_number(r"about 1{,}2345") is None
    assert last_number(r"about 1{,}5") is None and last_number("pages 1, 000") == "000"
    reward = MathReward(last_number_weight=0.5)
    stated = [r"it is 5{,}000", r"it is 5\!000", r"it is 5\,000", "it is 5000", "it is 5000", r"it is 5{,}000"]
    res = reward.score(stated, ["5000", "5000", "5000", r"5{,}000", r"5\!000", "0"])
    assert res.scores == [0.5] * 5 + [0.0]


#: (truth, boxed answer, correct): a quantity wholly inside a text command is read there, scale word included;
#: nothing is written into a text command. The old grader rewrote `\text{5 million}` as `\text{5 \cdot 10^{6}}`,
#: which math-verify reads as 10: right against 10 and against `\text{3 million}`, wrong against 5000000.
TEXT_SCALE_CASES = [
    (r"\text{5 million}", "10", 0.0),
    (r"\text{5 million}", r"\text{3 million}", 0.0),
    (r"\text{5 million}", "5000000", 1.0),
    (r"\text{5 million}", "5 million", 1.0),
    (r"\text{5 million}", r"\text{5 million}", 1.0),
    (r"\text{5 million}", "5", 0.0),
    ("5000000", r"\text{5 million}", 1.0),
    ("5", r"\text{5 million}", 0.0),
    (r"\text{5 million dollars}", "5000000", 1.0),
    (r"\mbox{1.5 billion}", "1500000000", 1.0),
    (r"\text{about 5 million}", "10", 0.0),
    ("10", r"\text{about 5 million}", 0.0),
    (r"\text{about 5 million}", r"\text{about 5 million}", 1.0),
    # outside a text command the rewrite stays
    ("x = 5000000", r"x = 5\text{ million}", 1.0),
]


@pytest.mark.parametrize(("truth", "answer", "expected"), TEXT_SCALE_CASES)
def test_scale_words_inside_a_text_command(truth: str, answer: str, expected: float) -> None:
    r"""`\text{5 million}` is 5000000, never what math-verify makes of a power of ten written into a text."""
    _graded_and_voted(truth, answer, expected)


def test_unicode_minus_is_a_minus_sign() -> None:
    """U+2212 (copied from rendered math) is `-`: `\u22121,000` and `\u22125\\%` were graded wrong against -1000
    and -0.05, an unboxed `\u22125` earned no last-number credit, and the vote split `\u22120.5` from -0.5."""
    m = "\u2212"
    reward = MathReward(last_number_weight=0.5)
    res = reward.score(
        [f"\\boxed{{{m}1,000}}", f"\\boxed{{{m}5\\%}}", f"\\boxed{{{m}5}}", f"so {m}5", f"pages 10{m}12"],
        ["-1000", "-0.05", "5", "-5", "12"],
    )
    assert res.scores == [1.0, 1.0, 0.0, 0.5, 0.5]
    assert last_number(f"x = {m}5") == "-5"
    assert reward.extract_answer(f"\\boxed{{{m}\\frac{{1}}{{2}}}}") == "-0.5"


def _score_in_thread(reward: MathReward, responses: list[str], answers: list[str]) -> tuple[RewardResult, float]:
    out: dict[str, RewardResult] = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.update(r=reward.score(responses, answers)))
    t.start()
    t.join(60)
    assert "r" in out, "scoring in a thread did not finish"
    return out["r"], time.monotonic() - t0


def _in_fresh_process(test: str) -> None:
    """Run `test` of this module in a fresh interpreter: the verifier forks, and in the full suite's process (many
    threads and patched modules left by earlier tests) these two checks failed while passing alone (2026-12-03,
    not yet explained: see the session note)."""
    import os
    import subprocess
    import sys

    if os.environ.get("ROLL_FRESH_PROCESS") == test:
        return
    target = __file__ + "::" + test
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import pytest; "
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {target!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ROLL_FRESH_PROCESS": test},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_math_reward_verifies_off_the_main_thread() -> None:
    """A threaded actor or an environment thread scores LaTeX answers with the same verification."""
    import os

    if os.environ.get("ROLL_FRESH_PROCESS") != "test_math_reward_verifies_off_the_main_thread":
        return _in_fresh_process("test_math_reward_verifies_off_the_main_thread")
    # Answers only math-verify grades (fractions of integers are compared exactly, without it).
    res, _ = _score_in_thread(MathReward(), [r"\boxed{\frac{\sqrt{4}}{4}}", r"\boxed{\sqrt{2}}"], ["0.5", "0.5"])
    assert res.correct == [1.0, 0.0]
    assert res.counters["timeouts"] == res.counters["errors"] == 0


def test_math_reward_timeout_works_off_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verification that hangs where SIGALRM cannot reach (here: off the main thread and outside math-verify's
    own timeout) is cut off by the process deadline, counted, and the next answer is verified by a fresh child."""
    import os

    if os.environ.get("ROLL_FRESH_PROCESS") != "test_math_reward_timeout_works_off_the_main_thread":
        return _in_fresh_process("test_math_reward_timeout_works_off_the_main_thread")
    import math_verify

    real = math_verify.verify

    def hang_on_thirds(gold, pred, **kwargs):  # inherited by the forked verifier
        if "3" in str(pred):
            time.sleep(30)
        return real(gold, pred, **kwargs)

    monkeypatch.setattr(math_verify, "verify", hang_on_thirds)
    reward = MathReward(timeout_s=1)
    # Answers only math-verify grades (fractions of integers are compared exactly, without it).
    responses = [r"\boxed{\sqrt{3}}", r"\boxed{\frac{\sqrt{4}}{4}}"]
    res, seconds = _score_in_thread(reward, responses, [r"\sqrt{3}", "0.5"])
    assert res.counters["timeouts"] == 1 and res.correct == [0.0, 1.0]
    assert seconds < 15, f"the hang was not cut off ({seconds:.1f}s)"


def test_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        MathReward().score(["a", "b"], ["1"])


def test_countdown_takes_the_multiplication_and_division_signs() -> None:
    assert evaluate_equation("(3 × 8) ÷ 2 − 1") == (11, [3, 8, 2, 1])


def test_countdown_equation_parsing() -> None:
    value, used = evaluate_equation("(3 + 5) * 2")
    assert value == 16 and sorted(used) == [2, 3, 5]
    for bad in ("__import__('os')", "2 ** 10", "1/0", "x + 1"):
        with pytest.raises(ValueError):
            evaluate_equation(bad)


@pytest.mark.parametrize(
    ("equation", "value", "used"),
    [
        (r"2\left(3+5\right)", 16, [2, 3, 5]),  # 2*8
        ("2(3+5)", 16, [2, 3, 5]),
        ("2 (3) (4)", 24, [2, 3, 4]),  # spaces between the factors, a chain of them
        ("(1+2)(3+4)", 21, [1, 2, 3, 4]),  # 3*7
        (r"[1+2]\{3+4\}", 21, [1, 2, 3, 4]),  # brackets and braces group as parentheses
        ("23(4-3)", 23, [23, 4, 3]),  # 23*1: digits are never split into 2*3
        ("6 - 2(1+2)", 0, [6, 2, 1, 2]),  # the product binds before the minus: 6 - 6
        ("(6/2)(1+2)", 9, [6, 2, 1, 2]),  # 3*3
        (r"\frac{6}{2}(1+2)", 9, [6, 2, 1, 2]),
        (r"\frac{6}{2(1+2)}", 1, [6, 2, 1, 2]),  # 6/6
    ],
)
def test_countdown_reads_implicit_products(equation: str, value: int, used: list[int]) -> None:
    # These were "not an expression" (a right answer scored 0 and counted as an error).
    assert evaluate_equation(equation) == (value, used)


@pytest.mark.parametrize(
    "equation",
    [
        "6/2(1+2)",  # 9 read left to right, 1 in sympy's LaTeX grammar: ambiguous
        "6/(2)(1+2)",
        "6/-2(1+2)",  # a sign between does not settle it
        r"6 \div 2\left(1+2\right)",
        "2 3",  # 23 or 2*3: not read either way
        "(3+5)2",  # only an opening parenthesis makes a product
    ],
)
def test_countdown_refuses_ambiguous_juxtaposition(equation: str) -> None:
    with pytest.raises(ValueError):
        evaluate_equation(equation)
    result = CountdownReward().score([f"\\boxed{{{equation}}}"], ["9|6,2,1,2"])
    assert result.correct == [0.0] and result.counters["errors"] == 1


def test_countdown_reward_scores_an_implicit_product() -> None:
    res = CountdownReward().score(
        [r"\boxed{2\left(3+5\right)}", r"\boxed{(1+2)(3+4) = 21}"], ["16|2,3,5", "21|1,2,3,4"]
    )
    assert res.correct == [1.0, 1.0] and res.counters["errors"] == 0


def test_countdown_reward() -> None:
    res = CountdownReward(format_weight=0.1).score(
        [r"\boxed{(3 + 5) * 2}", r"\boxed{3 * 5 + 2}", r"\boxed{(3+5)*2*1}", "16"],
        ["16|2,3,5", "16|2,3,5", "16|2,3,5", "16|2,3,5"],
    )
    assert res.scores == pytest.approx([1.1, 0.1, 0.1, 0.0])
    assert res.counters == {"errors": 0, "no_boxed": 1, "wrong_numbers": 1}
