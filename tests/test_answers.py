"""``kernels.answers``: an answer is made once per key, and a table that reaches ``KEPT`` answers starts again
rather than growing without end."""
from fluxpy.kernels import answers


def test_an_answer_is_made_once_and_the_table_is_bounded(monkeypatch):
    monkeypatch.setattr(answers, "KEPT", 3)
    table, made = {}, []

    def make(k):
        made.append(k)
        return k * 10
    for k in (1, 2, 1, 3, 2):
        assert answers.answered(table, k, lambda k=k: make(k)) == k * 10
    assert made == [1, 2, 3] and len(table) == 3
    assert answers.answered(table, 4, lambda: make(4)) == 40
    assert table == {4: 40}   # full at 3: emptied, then the new answer kept
    assert answers.answered(table, 1, lambda: make(1)) == 10 and made == [1, 2, 3, 4, 1]
