"""``make bench`` copies each results table into the README between its markers."""

from benchmarks import readme


def test_fill_replaces_written_tables_and_keeps_pending_ones(tmp_path):
    (tmp_path / "chat.md").write_text("| a |\n|---|\n| 1 |\n")
    text = ("intro\n<!-- results: chat -->\nold table\n<!-- /results -->\nmiddle\n"
            "<!-- results: serving -->\n_Pending_\n<!-- /results -->\n")
    filled = readme.fill(text, tmp_path)
    assert filled == ("intro\n<!-- results: chat -->\n\n| a |\n|---|\n| 1 |\n\n<!-- /results -->\nmiddle\n"
                      "<!-- results: serving -->\n_Pending_\n<!-- /results -->\n")
    assert readme.fill(filled, tmp_path) == filled  # running it again changes nothing
