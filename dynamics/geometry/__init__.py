"""Geometry of parameter space: planes through it (bases, projections, grids), loss landscapes
on them, the stored buffers nearest a point, and the overlap of subspaces."""
