"""What people and programs talk to: the HTTP API and its service layer, the Console, metrics, recovery-ctl, the report and the checks."""
