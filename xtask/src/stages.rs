//! The stages of `cargo xtask test`, timed: each is announced with the
//! time since the run began (a CI log that ends early still says where
//! the time went), and a table of every stage's time closes the run,
//! whether it passed or not.

use std::time::{Duration, Instant};

/// The stages run so far, in order.
pub struct Stages {
    started: Instant,
    done: Vec<(String, Duration)>,
    /// The stage under way: its title and when it began.
    current: Option<(String, Instant)>,
}

impl Stages {
    pub fn new() -> Self {
        Self { started: Instant::now(), done: Vec::new(), current: None }
    }

    /// Ends the stage under way, if any, and begins `title`.
    pub fn begin(&mut self, title: &str) {
        self.end();
        let secs = self.started.elapsed().as_secs();
        println!("==> {title} (at {}:{:02})", secs / 60, secs % 60);
        self.current = Some((title.to_owned(), Instant::now()));
    }

    /// Ends the stage under way.
    fn end(&mut self) {
        if let Some((title, began)) = self.current.take() {
            self.done.push((title, began.elapsed()));
        }
    }

    /// Ends the stage under way and prints the table, with `outcome` (how
    /// the run ended) in its last line.
    pub fn finish(mut self, outcome: &str) {
        self.end();
        println!("{}", table(&self.done, self.started.elapsed(), outcome));
    }
}

/// The closing table: each stage's minutes and seconds, then the total.
fn table(done: &[(String, Duration)], total: Duration, outcome: &str) -> String {
    let width = done.iter().map(|(title, _)| title.len()).max().unwrap_or(0).max(5);
    let clock = |d: Duration| format!("{:>3}:{:02}", d.as_secs() / 60, d.as_secs() % 60);
    let mut text = format!("==> stage times\n{:<width$}  min:s\n", "stage");
    for (title, took) in done {
        text.push_str(&format!("{title:<width$}  {}\n", clock(*took)));
    }
    text.push_str(&format!("{:<width$}  {}  ({outcome})", "total", clock(total)));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_each_stage_and_the_total() {
        let done = [
            ("lints".to_owned(), Duration::from_secs(75)),
            ("host tests".to_owned(), Duration::from_secs(3_601)),
        ];
        let text = table(&done, Duration::from_secs(3_700), "passed");
        assert_eq!(
            text,
            "==> stage times\n\
             stage       min:s\n\
             lints         1:15\n\
             host tests   60:01\n\
             total        61:40  (passed)"
        );
    }
}
