from bench.engine_speed.run import main

raise SystemExit(main())
