//! A table of the bench's report, rendered as aligned text or as Markdown.

/// A table, rendered as aligned text or as Markdown.
pub(super) struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(super) fn new(title: &str, headers: &[&str]) -> Self {
        Self {
            title: title.to_owned(),
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub(super) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(super) fn text(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.headers[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| {
            let mut out = String::from("  ");
            for (i, cell) in cells.iter().enumerate() {
                let pad = widths[i] - cell.chars().count();
                out += cell;
                out += &" ".repeat(pad + 3);
            }
            out.trim_end().to_owned() + "\n"
        };
        let mut out = format!("{}\n", self.title);
        out += &line(&self.headers);
        out +=
            &format!("  {}\n", "-".repeat(widths.iter().sum::<usize>() + 3 * (widths.len() - 1)));
        for row in &self.rows {
            out += &line(row);
        }
        out
    }

    pub(super) fn markdown(&self) -> String {
        let mut out = format!(
            "### {}\n\n| {} |\n|{}\n",
            self.title,
            self.headers.join(" | "),
            "---|".repeat(self.headers.len())
        );
        for row in &self.rows {
            out += &format!("| {} |\n", row.join(" | "));
        }
        out + "\n"
    }
}
