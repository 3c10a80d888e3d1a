//! How figures are written, in the report and in the progress lines.

use std::time::Duration;

/// A duration as "123 ms" or, from 1 s, "1.23 s".
pub fn ms(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    }
}

/// A count with a thousands separator: "16,384".
pub fn count(n: usize) -> String {
    if n >= 1000 { format!("{},{:03}", count(n / 1000), n % 1000) } else { n.to_string() }
}

/// "1 service", "1,000 services".
pub fn services(n: usize) -> String {
    if n == 1 { "1 service".to_owned() } else { format!("{} services", count(n)) }
}

/// Milliseconds as "12.3 ms" or, from 1 s, "1.23 s".
pub fn millis(value: f64) -> String {
    if value >= 1000.0 { format!("{:.2} s", value / 1e3) } else { format!("{value:.1} ms") }
}
