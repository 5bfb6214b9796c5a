"""The paper's reproduction: its claims judged over seed groups (:mod:`.claims`) and the page
that reports them (:mod:`.reproduction_page`), beside the experiments that produce the runs."""
