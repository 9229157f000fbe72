//! Progress in the terminal for long commands (`demo`, `research follow`, `bench`).
//! Invariant: a bar is drawn only when stdout is a terminal; otherwise every update that
//! matters is one plain line, so logs and pipes read the same as before.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on a terminal, plain lines elsewhere.
pub struct Bar {
    bar: Option<ProgressBar>,
}

impl Bar {
    /// A bar of `len` units labelled `label`; drawn only when stdout is a terminal.
    pub fn new(len: u64, label: &str) -> Self {
        Self::with_terminal(len, label, std::io::stdout().is_terminal())
    }

    pub fn with_terminal(len: u64, label: &str, terminal: bool) -> Self {
        let bar = terminal.then(|| {
            let b = ProgressBar::new(len);
            b.set_style(
                ProgressStyle::with_template(
                    "{prefix:>12.cyan.bold} [{bar:30.green/white}] {pos}/{len} {wide_msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_prefix(label.to_owned());
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Self { bar }
    }

    /// Whether a bar is drawn.
    pub fn is_drawn(&self) -> bool {
        self.bar.is_some()
    }

    /// Prints a line above the bar (or as a plain line).
    pub fn println(&self, line: impl AsRef<str>) {
        match &self.bar {
            Some(b) => b.println(line.as_ref()),
            None => println!("{}", line.as_ref()),
        }
    }

    pub fn set(&self, pos: u64, msg: impl Into<String>) {
        if let Some(b) = &self.bar {
            b.set_position(pos);
            b.set_message(msg.into());
        }
    }

    pub fn inc(&self, msg: impl Into<String>) {
        if let Some(b) = &self.bar {
            b.inc(1);
            b.set_message(msg.into());
        }
    }

    /// Removes the bar; what was printed above it stays.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::Bar;

    #[test]
    fn without_a_terminal_nothing_is_drawn() {
        let b = Bar::with_terminal(5, "compiling", false);
        assert!(!b.is_drawn());
        b.inc("one");
        b.set(3, "three");
        b.finish();
    }

    #[test]
    fn on_a_terminal_the_bar_counts() {
        let b = Bar::with_terminal(5, "compiling", true);
        assert!(b.is_drawn());
        b.inc("one");
        b.inc("two");
        assert_eq!(b.bar.as_ref().map(|b| b.position()), Some(2));
        b.set(4, "four");
        assert_eq!(b.bar.as_ref().map(|b| b.position()), Some(4));
    }
}
