"""The README's loss table is the registry's (so docs and code cannot drift apart)."""

from pathlib import Path

from jaxrl_llm.losses.registry import LOSS_SPECS, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_shows_the_registry_table():
    assert markdown_table() in README.read_text()


def test_table_marks_follow_the_specs():
    rows = {line.split("|")[1].strip(" `"): line for line in markdown_table().splitlines()[2:]}
    assert set(rows) == set(LOSS_SPECS)
    # a hand-written expectation of the two data requirements that broke before
    assert rows["dpo"].split("|")[3:5] == [" ✓ ", " ✓ "]  # π_ref and pairs
    assert rows["grpo"].split("|")[2].strip() == "✓" and rows["grpo"].split("|")[5].strip() == "✓"
    assert rows["fpa"].split("|")[3].strip() == "model"


def test_options_column_lists_each_loss_s_own_keys():
    # the last cell (`minimises` may hold escaped pipes, so split from the right)
    options = {line.split("|")[1].strip(" `"): line.rsplit("|", 2)[1].strip()
               for line in markdown_table().splitlines()[2:]}
    assert options["m2po"] == "`m2po_tau`, `m2po_mask`, `std_ddof`"
    assert options["icepop"] == ("`icepop_alpha`, `icepop_beta`, `icepop_level`, "
                                 "`icepop_aggregation`, `std_ddof`")
    assert options["dr_grpo"] == "`clip_eps`, `clip_eps_low`, `clip_eps_high`, `dual_clip_c`"
    assert options["off_rl"] == ""
