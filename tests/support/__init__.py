"""Shared test support: references, case builders, the MPI rank driver."""
