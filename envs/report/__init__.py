"""What a sweep shows a person: grouped tables and intervals (``summary``), the collapse study
(``collapse``), PNG figures (``plots``) and report.md (``sweep_report``). Imports ``sweep`` and below."""
