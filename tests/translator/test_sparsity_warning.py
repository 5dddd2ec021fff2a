"""The end-of-run advice to raise alpha: given only when steps ran and P stayed as dense as its start."""
from s2t2_dist.translator.stats import sparsity_warning

DENSE = {"density": 0.5, "col_nnz_mean": 12.0, "col_entropy_mean": 2.0}
SPARSER = {"density": 0.2, "col_nnz_mean": 5.0, "col_entropy_mean": 1.2}
SPARSE_START = {"density": 0.02, "col_nnz_mean": 2.0, "col_entropy_mean": 0.5}


def test_warns_when_trained_p_is_as_dense_as_its_start():
    w = sparsity_warning(DENSE, dict(DENSE), steps=200)
    assert "no sparser than its start" in w and "translator.alpha" in w and "12.0" in w


def test_silent_when_p_got_sparser_or_the_start_is_already_sparse():
    assert sparsity_warning(DENSE, SPARSER, steps=200) == ""
    assert sparsity_warning(SPARSE_START, dict(SPARSE_START), steps=200) == ""


def test_a_run_of_no_steps_scores_the_start_and_is_not_told_to_raise_alpha():
    # train.steps=0 evaluates the start: end == start by construction, which is no evidence about alpha
    assert sparsity_warning(DENSE, dict(DENSE), steps=0) == ""
