"""bench/head_marginal.py's map from source tokens to the target token that begins them (a diagnostic): the
longest target-token prefix of each source token's bytes, specials and tokens with no prefix left out."""
import torch

from bench.head_marginal import prefix_map


def test_each_source_token_maps_to_its_longest_target_prefix():
    target = {0: None, 1: b"t", 2: b"th", 3: b"the", 4: b" a", 5: b"x"}
    source = [b"there", b"th", b"t", b" and", b"q", None, b"", b"xth", b"tx"]
    assert prefix_map(target, source).tolist() == [3, 2, 1, 4, -1, -1, -1, 5, 1]


def test_marginal_of_a_distribution_is_a_distribution():
    """Summing p over the source tokens of each target column (index_add, as the script does) keeps the total."""
    f = prefix_map({0: b"a", 1: b"b"}, [b"ab", b"b", b"aa", b"c"])
    mapped = f >= 0
    p = torch.softmax(torch.randn(3, int(mapped.sum())), -1)
    q = torch.zeros(3, 2).index_add_(-1, f[mapped], p)
    assert torch.allclose(q.sum(-1), torch.ones(3)) and f.tolist() == [0, 1, 0, -1]
