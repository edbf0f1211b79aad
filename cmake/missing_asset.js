/* memfl: this front-end library was not installed at build time (npm ci --prefix report-assets) */
