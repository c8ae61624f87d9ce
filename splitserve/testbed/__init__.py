"""Test beds: several hosts on one machine (`netbed`), with a bulk flow to share their links (`bulk`)."""
