"""``row_ids``: the audit's exact grouping of observation and feature rows."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdm_lab.envs.audit import flips as audit_flips
from pdm_lab.envs.audit.flips import row_ids


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a[:, None] == a[None, :]) == (b[:, None] == b[None, :])).all())


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 6), st.integers(1, 4), st.booleans(), st.integers(0, 2 ** 31))
def test_row_ids_groups_exactly_the_equal_rows(m, f, values, floating, seed):
    rows = torch.randint(0, values, (m, f), generator=torch.Generator().manual_seed(seed))
    if floating:
        rows = rows.float() * 0.37
    ids = row_ids(rows)
    assert ids.dtype == torch.int64 and ids.shape == (m,)
    if m:
        reference = torch.unique(rows, dim=0, return_inverse=True)[1]
        assert _same_partition(ids, reference)
        assert set(ids.tolist()) == set(range(int(reference.max()) + 1))  # ids 0…G−1


def test_row_ids_survives_a_hash_collision(monkeypatch):
    # every row hashing alike (planted): the check against each group's first row must catch it
    monkeypatch.setattr(audit_flips, "_HASH_WEIGHTS", torch.zeros(4, dtype=torch.int64))
    rows = torch.tensor([[0, 1], [1, 0], [0, 1], [2, 2]])
    assert _same_partition(row_ids(rows), torch.tensor([0, 1, 0, 2]))


def test_row_ids_wide_rows_use_every_column():
    # more columns than hash weights: columns past the table still separate rows
    rows = torch.zeros(2, 5000, dtype=torch.int64)
    rows[1, 4097] = 1
    ids = row_ids(rows)
    assert ids[0] != ids[1]
    hashes = audit_flips.row_hashes(rows)  # separated by the hash itself, not by the fallback sort
    assert hashes[0] != hashes[1]


def test_row_ids_reads_float64_rows_at_full_precision():
    # two float64 rows that round to the same float32: the hash must still tell them apart
    rows = torch.tensor([[1.0], [1.0 + 2.0 ** -40]], dtype=torch.float64)
    assert audit_flips.row_hashes(rows)[0] != audit_flips.row_hashes(rows)[1]
    ids = row_ids(rows)
    assert ids[0] != ids[1]
