"""numpy models of the CUDA kernels' index and plan arithmetic (tests/test_index_models.py).

Each module models one kernel's blocks, threads, staging and stores as the kernel computes
them, and checks the result against a plain formula (numpy's FFTs, einsums), with shared
memory modelled as NaN-filled arrays so that a read of anything not written shows. They check
the index algebra, not the kernels: the CUDA tests on a GPU do that.
"""
