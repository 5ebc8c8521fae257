"""What crosses a process boundary, with no dependency of its own: every side imports it (router, controller,
workers, reconfigctl), so that none has to import another's package to speak to it."""
