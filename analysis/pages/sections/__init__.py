"""HTML sections more than one page holds, or one a page is made of, one module per measure
(the overshoot verdicts, the bias audit, the loss barriers, the displacement geometry)."""
