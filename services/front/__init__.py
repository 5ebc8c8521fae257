"""The front router: one OpenAI API over several instances, with MELL placement and live moves."""
