"""The HTML pages: the report of runs (:mod:`.run_report`), their comparison
(:mod:`.run_comparison`), the comparison of seed groups (:mod:`.group_comparison`) and the plane
views (:mod:`.plane`), all on the kit of :mod:`.page`. A page never imports another: what two
pages share is a section in :mod:`.sections`.
"""
