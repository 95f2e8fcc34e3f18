"""The verdict rules of roll_envs.rewards._judge_parse: a judge reply whose verdict is ambiguous (a label in a question,
a leading label taken back, marked verdicts that disagree, a label used as a word: `no doubt`, `no errors`) is an
invalid verdict (`judge_invalid`), never the wrong grade; plain verdicts still read as before."""

from __future__ import annotations

import pytest

from roll_envs.rewards._judge_parse import VerdictParser
from roll_envs.rewards._judge_spec import JudgeSpec

YES_NO = VerdictParser({"yes": 1.0, "no": 0.0})
CORRECT = VerdictParser({"correct": 1.0, "incorrect": 0.0})


@pytest.mark.parametrize(
    ("parser", "reply"),
    [
        # the reply opens with a label in a question: the question, not the verdict (scored correct before)
        (CORRECT, "Correct? No."),
        (CORRECT, "Correct? No, the units differ."),
        (CORRECT, "Is the response correct? No."),
        # a label used as a field name, its value another word (scored correct before)
        (CORRECT, "Correct: no"),
        # a yes/no answering the judge's own question, which may be the opposite of the template's
        (YES_NO, "Incorrect? Yes."),
        (YES_NO, "Is it wrong? No."),
        # `no` as a word, not an answer (scored 0 for replies that accept the response)
        (YES_NO, "No doubt, the answer is correct."),
        (YES_NO, "The answer is correct, no errors."),
        # a leading label taken back (scored as the first label)
        (YES_NO, "Yes, wait, no."),
        (YES_NO, "Yes - but no, actually the answer is wrong."),
        (YES_NO, "Yes or no? No."),
        (CORRECT, "Correct, although on reflection it is incorrect."),
        # marked verdicts that disagree: the last one was taken
        (YES_NO, "Verdict: yes. If the unit were required, the verdict: no"),
        (CORRECT, "[[correct]] ... [[incorrect]]"),
        (YES_NO, "The response's answer: yes. The reference answer: no."),
        # a double negation: no label stated
        (CORRECT, "The answer is not incorrect."),
        # two labels, one stated: no verdict
        (CORRECT, "I cannot say if it is correct or incorrect."),
    ],
)
def test_an_ambiguous_reply_is_an_invalid_verdict_not_a_grade(parser: VerdictParser, reply: str) -> None:
    assert parser(reply) is None, reply


def test_plain_verdicts_still_read() -> None:
    """What the rules always read: a marked verdict (also after text quoting the other label, also in bold), a
    reply opening with a label whose explanation names the other only as a word or negated, the only label."""
    assert CORRECT("The student wrote 'incorrect' data.\nVerdict: correct") == 1.0
    assert CORRECT("It says incorrect twice, then fixes it.\n**Verdict**: **correct**") == 1.0
    assert CORRECT("Verdict: correct\nNote: without the unit it would be incorrect.") == 1.0
    assert CORRECT("**Incorrect**") == 0.0 and CORRECT("**Incorrect**. The form is correct in places.") == 0.0
    assert CORRECT("Incorrect. The response is not correct.") == 0.0  # the other label negated agrees
    assert CORRECT("Correct. The response says 'incorrect' nowhere.") == 1.0
    assert YES_NO("YES. It matches, no errors.") == 1.0 and YES_NO("Yes, no issues.") == 1.0
    assert YES_NO("No. It is not yes: 5 is not 4.") == 0.0
    assert YES_NO("The response is wrong, so no.") == 0.0 and YES_NO("<think>yes?</think>\n**No**") == 0.0
    assert YES_NO("Verdict: yes. Verdict: yes") == 1.0  # a verdict repeated is one verdict
    assert YES_NO("Verdict: no (the response's final answer: yes, the reference answer: no... answer: yes)") == 0.0
    assert YES_NO("The reference answer: yes. The response's answer: no.\nAnswer: no") == 0.0  # its own line wins
    assert YES_NO("Reasoning done.\nAnswer: no") == 0.0


def test_a_verdict_after_an_echo_of_the_templates_question_reads() -> None:
    """`Is the response correct? Yes.` under a template asking just that was an invalid verdict (a `?` before the
    label); the echo is dropped now. A question of the judge's own and an echo answered both ways stay invalid."""
    own = JudgeSpec.resolve(
        "{prompt}\n{response}\n{answer}\nIs the response correct? Answer yes or no.",
        None, None, None, None, {"yes": 1.0, "no": 0.0}, None,
    )  # fmt: skip
    p = own.parser
    assert p("Is the response correct? Yes.") == 1.0 and p("**Is the response  correct?** No") == 0.0
    assert p("The response says 5, the reference 5. Is the response correct? Yes, it is.") == 1.0
    assert p("Is the response correct?\nVerdict: no") == 0.0
    for invalid in (
        "Is it wrong? No.",  # the judge's own question: its yes/no may be the template's opposite
        "Is the response correct? Yes. Is the response correct? No.",  # both labels as verdicts
        "Is the response correct? Yes or no? No.",
        "Is the response correct? Yes, wait, no.",
        "Is the response correct?",
    ):
        assert p(invalid) is None, invalid
    # the built-in verdict template's question; a question in a field's value (the prompt's) is no echo
    builtin = JudgeSpec.resolve("verdict", None, None, None, None, None, None).parser
    assert builtin("Does the response give an answer equivalent to the reference answer? No.") == 0.0
    asks = JudgeSpec.resolve("Q: {prompt}\n{response}\nVerdict?", None, "verdict", None, None, None, None).parser
    assert asks("Is 7 prime? Yes.") is None and asks("Verdict? yes") == 1.0
    # the parser alone (no template) knows no echo
    assert YES_NO("Is the response correct? Yes.") is None
