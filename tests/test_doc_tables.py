"""The docs print the code's contract tables (`tests/doc_tables.py`): they cannot drift."""

import os

import pytest

from tests import doc_tables


@pytest.mark.parametrize("name", sorted(doc_tables.TABLES))
def test_each_contract_table_in_the_docs_is_the_codes(name):
    make, doc = doc_tables.TABLES[name]
    with open(os.path.join(doc_tables.ROOT, doc)) as f:
        text = f.read()
    assert doc_tables.rendered(name, text) == text, (
        f"{doc}: the `{name}` table differs from the code's; run `python -m tests.doc_tables`")
    assert make().count("\n") >= 3  # a header, its rule and rows
