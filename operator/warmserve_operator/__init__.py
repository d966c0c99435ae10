"""warmserve_operator."""
