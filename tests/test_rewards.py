import itertools
import time


from rewards import MATH_TIMEOUT, accuracy, boxed_accuracy, final_answer, format, tag_count


def test_accuracy_uses_math_verify_on_the_final_answer():
    got = accuracy(["so the answer is \\boxed{27}", "13 + 14 = 27", "It is 26.", "\\boxed{27.0}", "", "\\boxed{1,000}",
                    "27 or \\boxed{26}"], ["27", "27", "27", "27", "27", "1000", "27"])
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    # a LaTeX reference: math-verify's own extraction and equivalence
    assert accuracy(["\\boxed{\\frac{2}{4}}", "x = \\boxed{0.5}", "\\boxed{\\frac{1}{3}}"], ["\\frac{1}{2}"] * 3) == [1, 1, 0]


def test_accuracy_needs_a_number_where_the_reference_is_one():
    """Restating the question, or boxing an expression that equals the answer, is not answering it: a policy
    rewarded for that learns to repeat the question (seen on the embedded task before this rule)."""
    completions = ["The puzzle of 13 + 14 is a deep one.", "\\boxed{13 + 14}", "\\boxed{\\frac{54}{2}}",
                   "13 + 14 is \\boxed{27", "When faced with 13 + 14, I would think."]
    assert accuracy(completions, ["27"] * len(completions)) == [0.0] * len(completions)
    assert final_answer("a \\boxed{\\frac{1}{2}} then \\boxed{x^{2}}") == "x^{2}"
    assert final_answer("12 apples and 3.5 pears") == "3.5" and final_answer("no digits") == ""


PATHOLOGICAL = ["\\boxed{" * 3000, "9" * 50_000, "\\boxed{10^{10^{10^{10^{10^{10}}}}}}", "$" * 5000,
                "\\frac{" * 500 + "1" + "}{2}" * 500, "\\boxed{x^{99999999} - x^{99999998}}", "\\boxed{\\sqrt{" * 300,
                "\\begin{pmatrix}" * 200, "\\boxed{27}\x00\ufffd" + "\\left(" * 1000, "((((" * 2000 + "27"]


def test_accuracy_survives_pathological_input_in_bounded_time():
    """math-verify on input built to be slow or to break a parser: a score for each (never a crash), each within
    its timeouts: the reference's parse, the completion's and the comparison, MATH_TIMEOUT each (a bound on a
    hang, not a speed claim). Against a symbolic reference too, which a number's final answer does not shortcut
    (a tower of powers took 10 s there: its arithmetic runs past the time-out)."""
    for text, ref in itertools.product(PATHOLOGICAL, ["27", "x^{2}"]):
        t = time.monotonic()
        got = accuracy([text], [ref])
        assert got in ([0.0], [1.0]), (text[:40], got)
        assert time.monotonic() - t < 3 * MATH_TIMEOUT, (text[:40], ref, time.monotonic() - t)
    assert accuracy(["so it is \\boxed{27}", "\\boxed{x^{2^{1}}}"], ["27", "x^2"]) == [1.0, 1.0]  # normal input


def test_boxed_accuracy_counts_only_a_right_answer_in_the_box():
    """The embedded task's reward: a plain right sum, a wrong boxed one, a box never closed and a right answer
    boxed twice (a run learned to write `so the answer is \\boxed{8}.` twice) earn nothing."""
    completions = ["13 + 14 = 27, so the answer is \\boxed{27}.", "13 + 14 = 27", "13 + 14 = 27, so \\boxed{26}",
                   "\\boxed{27", "27 \\boxed{27} \\boxed{27}", [{"role": "assistant", "content": "\\boxed{27}"}],
                   "so the answer is \\boxed{27}. so the answer is \\boxed{27}.", "x = \\boxed{27.0}"]
    assert boxed_accuracy(completions, ["27"] * len(completions)) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert accuracy(completions[:2], ["27", "27"]) == [1.0, 1.0]  # where plain accuracy takes the last number


def test_math_verify_runs_once_per_completion_and_reference():
    """boxed_accuracy and accuracy side by side (the embedded task's rewards) and a group's repeated samples
    ask math-verify the same question: it is answered once."""
    from rewards import _matches
    _matches.cache_clear()
    group = ["12 + 9 = 21, so the answer is \\boxed{21}."] * 6 + ["12 + 9 = 22", "\\boxed{21}"]
    assert accuracy(group, ["21"] * 8) == [1.0] * 6 + [0.0, 1.0]
    assert boxed_accuracy(group, ["21"] * 8) == [1.0] * 6 + [0.0, 1.0]
    assert _matches.cache_info().misses == 3


def test_format_wants_exactly_one_boxed_number():
    assert format(["\\boxed{12}", "\\boxed{ -3.5 }", "12", "\\boxed{1} \\boxed{2}", "\\boxed{x}"]) == [1, 1, 0, 0, 0]
    assert format([[{"role": "assistant", "content": "\\boxed{12}"}]]) == [1]  # a chat completion: its message
    # a full stop inside the box: a number to both rewards (a run's answers settled on "\boxed{12.}" once)
    assert format(["so the answer is \\boxed{12.}"]) == [1] and accuracy(["\\boxed{12.}"], ["12"]) == [1]
    assert accuracy(["\\boxed{.5}", "\\boxed{0.5}"], ["5", "0.5"]) == [0, 1]  # but a leading point is the number's


def test_tag_count():
    assert tag_count(["<think>a</think><answer>1</answer>", "<think>", "none"]) == [1.0, 0.25, 0.0]


def test_choice_reads_the_boxed_choice_or_the_first_one_named():
    from rewards import choice
    completions = ["It is odd.", "\\boxed{Even}", "odd? no: even", "oddly, it is even", "neither", "\\boxed{odd}.",
                   [{"role": "assistant", "content": "EVEN"}], "even \\boxed{odd}"]
    answers = ["odd", "even", "odd", "even", "odd", "even", "even", "odd"]
    got = choice(completions, answers, [["even", "odd"]] * len(completions))
    # a whole word only ("oddly" is not "odd"); the box wins over a word named before it
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert choice(["B) Paris"], ["Paris"], [["London", "Paris"]]) == [1.0]  # phrases of a multiple-choice column


def test_the_parity_task_holds_out_the_multiples_of_11_and_its_answers_are_right():
    from embedded import parity_problems
    number = lambda row: int(row["prompt"].split()[1])
    test, train = parity_problems(0, seed=0, split="test"), parity_problems(2000, seed=0)
    assert sorted(map(number, test)) == list(range(11, 1000, 11))  # each once
    assert not any(number(r) % 11 == 0 for r in train) and len({number(r) for r in train}) > 800
    assert all(r["answer"] == ("even" if number(r) % 2 == 0 else "odd") and r["choices"] == ["even", "odd"]
               for r in test + train)


def test_an_empty_completion_is_an_empty_answer_in_either_form():
    """A trajectory whose environment failed before the model's first turn has no message; an assistant turn that
    only calls a tool may have no content (None, as the OpenAI SDK writes it): both read as "", never raise."""
    from rewards import completion_text
    assert completion_text([]) == "" and completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text("") == "" and completion_text([{"role": "assistant", "content": "x"}]) == "x"
    assert accuracy([[]], ["27"]) == [0.0] and format([[]]) == [0.0] and boxed_accuracy([[]], ["27"]) == [0.0]
