"""``kernels.answers``: an answer is made once per key, a table that reaches its bound starts again rather than
growing without end, one without a bound never forgets, and an unhashable key is answered at every call."""
from fluxpy.kernels import answers


def test_an_answer_is_made_once_and_the_table_is_bounded():
    table, made = {}, []

    def make(k):
        made.append(k)
        return k * 10
    for k in (1, 2, 1, 3, 2):
        assert answers.answered(table, k, lambda k=k: make(k), kept=3) == k * 10
    assert made == [1, 2, 3] and len(table) == 3
    assert answers.answered(table, 4, lambda: make(4), kept=3) == 40
    assert table == {4: 40}   # full at 3: emptied, then the new answer kept
    assert answers.answered(table, 1, lambda: make(1), kept=3) == 10 and made == [1, 2, 3, 4, 1]


def test_an_unbounded_table_never_forgets_and_an_unhashable_key_is_kept_nowhere():
    table = {}
    for k in range(answers.KEPT + 5):
        answers.answered(table, k, lambda k=k: k + 1, kept=None)
    assert len(table) == answers.KEPT + 5
    made = []
    for _ in range(2):
        assert answers.answered(table, ("axes", [0, 1]), lambda: made.append(1) or "checked") == "checked"
    assert made == [1, 1] and len(table) == answers.KEPT + 5
