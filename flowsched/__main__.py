from flowsched.cli import main

raise SystemExit(main())
