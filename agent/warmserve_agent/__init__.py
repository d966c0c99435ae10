"""warmserve_agent."""
