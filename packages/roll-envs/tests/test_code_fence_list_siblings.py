"""A fence under the second item of a numbered list (items on consecutive lines) is the program, as CommonMark
(markdown-it) renders it: the "only 1. interrupts text" rule held for sibling items too, so `no_code`."""

import pytest

from roll_envs.rewards.code import extract_code


@pytest.mark.parametrize(
    "response",
    [
        "Steps:\n\n1. Read the input.\n2. Print the answer:\n    ```python\n    print(int(input()) * 2)\n    ```\n",
        "- Read n.\n2. Print:\n    ```python\n    print(int(input()) * 2)\n    ```\n",
        "".join(f"{i}. step\n" for i in range(1, 10))
        + "10. Code:\n    ```python\n    print(int(input()) * 2)\n    ```\n",
    ],
)
def test_fence_under_a_sibling_item_is_the_program(response: str) -> None:
    assert extract_code(response) == "print(int(input()) * 2)\n"


def test_a_number_after_top_level_text_is_still_text() -> None:
    # No list is open: "2024." does not start one after text, so the 4-space line continues the paragraph.
    response = "It happened in\n2024. The code:\n    ```python\n    print(1)\n    ```\n"
    assert extract_code(response) is None
