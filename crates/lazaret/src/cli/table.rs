//! Plain-text tables for the terminal: aligned columns, cells cut to fit.
//!
//! Cells are sanitised first (newlines become spaces, other control and
//! bidi-override characters become `�`) because error messages and
//! payload-derived text come from outside and must neither break the
//! layout nor smuggle escape sequences into the operator's terminal.
//! Widths are display columns, not bytes or chars, so CJK and emoji line
//! up; cutting happens on `char` boundaries and keeps combining marks with
//! their base character.

use std::borrow::Cow;

/// The ellipsis that marks a cut cell.
const ELLIPSIS: char = '…';
/// Spaces between two columns.
const GAP: usize = 2;
/// A flexible column is never squeezed narrower than this.
const FLEX_WIDTH_MIN: usize = 12;

/// How a column's cells sit in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// One column: its header, alignment and how wide it may get.
#[derive(Debug, Clone)]
pub struct Column {
    header: Cow<'static, str>,
    align: Align,
    width_max: Option<usize>,
    flex: bool,
}

impl Column {
    /// A left-aligned column as wide as its widest cell.
    pub fn new(header: impl Into<Cow<'static, str>>) -> Self {
        Self {
            header: header.into(),
            align: Align::Left,
            width_max: None,
            flex: false,
        }
    }

    /// Right-aligns the column (counts).
    pub fn right(mut self) -> Self {
        self.align = Align::Right;
        self
    }

    /// Cuts cells longer than `width` columns.
    pub fn width_max(mut self, width: usize) -> Self {
        self.width_max = Some(width);
        self
    }

    /// Lets the table squeeze this column when the whole is too wide.
    pub fn flex(mut self) -> Self {
        self.flex = true;
        self
    }
}

/// A table built row by row and rendered to lines.
#[derive(Debug, Clone)]
pub struct Table {
    columns: Vec<Column>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(columns: Vec<Column>) -> Self {
        Self {
            columns,
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells are empty, extra cells are dropped.
    pub fn push<I, S>(&mut self, cells: I)
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut row: Vec<String> = cells
            .into_iter()
            .take(self.columns.len())
            .map(|c| clean_line(c.as_ref()).into_owned())
            .collect();
        row.resize(self.columns.len(), String::new());
        self.rows.push(row);
    }

    /// The header line and one line per row, none with trailing spaces.
    /// With `width_total_max`, flexible columns shrink (last first) until the
    /// table fits or they reach a floor.
    pub fn lines(&self, width_total_max: Option<usize>) -> Vec<String> {
        let mut widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, col)| {
                let header = display_width(&col.header);
                let content = self
                    .rows
                    .iter()
                    .map(|r| display_width(&r[i]))
                    .max()
                    .unwrap_or(0);
                let content = col.width_max.map_or(content, |m| content.min(m));
                content.max(header)
            })
            .collect();

        if let Some(total_max) = width_total_max {
            let total = |w: &[usize]| w.iter().sum::<usize>() + GAP * w.len().saturating_sub(1);
            for i in (0..self.columns.len()).rev() {
                let excess = total(&widths).saturating_sub(total_max);
                if excess == 0 {
                    break;
                }
                let col = &self.columns[i];
                if col.flex {
                    let floor = FLEX_WIDTH_MIN.max(display_width(&col.header));
                    widths[i] = widths[i].saturating_sub(excess).max(floor.min(widths[i]));
                }
            }
        }

        let header = self.columns.iter().map(|c| c.header.as_ref());
        std::iter::once(self.line(header, &widths))
            .chain(
                self.rows
                    .iter()
                    .map(|r| self.line(r.iter().map(String::as_str), &widths)),
            )
            .collect()
    }

    fn line<'a>(&self, cells: impl Iterator<Item = &'a str>, widths: &[usize]) -> String {
        let mut line = String::new();
        let last = self.columns.len().saturating_sub(1);
        for (i, (cell, col)) in cells.zip(&self.columns).enumerate() {
            if i > 0 {
                line.extend(std::iter::repeat_n(' ', GAP));
            }
            let cell = cut(cell, widths[i]);
            let pad = widths[i].saturating_sub(display_width(&cell));
            match col.align {
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(&cell);
                }
                Align::Left => {
                    line.push_str(&cell);
                    if i != last {
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
        }
        line.truncate(line.trim_end().len());
        line
    }
}

/// Cuts `s` to at most `width` display columns, marking a cut with `…`.
pub fn cut(s: &str, width: usize) -> Cow<'_, str> {
    if display_width(s) <= width {
        return Cow::Borrowed(s);
    }
    if width == 0 {
        return Cow::Borrowed("");
    }
    let budget = width - 1; // room for the ellipsis
    let mut out = String::new();
    let mut used = 0;
    for c in s.chars() {
        let w = char_width(c);
        if used + w > budget {
            break;
        }
        used += w;
        out.push(c);
    }
    // "value …" reads worse than "value…".
    out.truncate(out.trim_end().len());
    out.push(ELLIPSIS);
    Cow::Owned(out)
}

/// Columns `s` takes on a terminal (an approximation of `wcwidth`).
pub fn display_width(s: &str) -> usize {
    s.chars().map(char_width).sum()
}

fn char_width(c: char) -> usize {
    let cp = u32::from(c);
    if c.is_control() {
        return 0;
    }
    match cp {
        // Combining marks, zero-width joiners and spaces, variation selectors.
        0x0300..=0x036F
        | 0x0483..=0x0489
        | 0x0591..=0x05BD
        | 0x0610..=0x061A
        | 0x064B..=0x065F
        | 0x1AB0..=0x1AFF
        | 0x1DC0..=0x1DFF
        | 0x200B..=0x200F
        | 0x20D0..=0x20FF
        | 0xFE00..=0xFE0F
        | 0xFE20..=0xFE2F
        | 0xFEFF
        | 0xE0100..=0xE01EF => 0,
        // East Asian wide and fullwidth, emoji.
        0x1100..=0x115F
        | 0x2E80..=0x303E
        | 0x3041..=0x33FF
        | 0x3400..=0x4DBF
        | 0x4E00..=0x9FFF
        | 0xA000..=0xA4CF
        | 0xAC00..=0xD7A3
        | 0xF900..=0xFAFF
        | 0xFE30..=0xFE4F
        | 0xFF00..=0xFF60
        | 0xFFE0..=0xFFE6
        | 0x1F300..=0x1F64F
        | 0x1F900..=0x1F9FF
        | 0x20000..=0x2FFFD
        | 0x30000..=0x3FFFD => 2,
        _ => 1,
    }
}

/// Characters that reorder text on display (Trojan-source style).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// One line of outside text made safe for a table cell.
pub fn clean_line(s: &str) -> Cow<'_, str> {
    clean(s, false)
}

/// Outside text made safe for the terminal, keeping its line breaks and tabs.
pub fn clean_text(s: &str) -> Cow<'_, str> {
    clean(s, true)
}

fn clean(s: &str, keep_breaks: bool) -> Cow<'_, str> {
    let needs = |c: char| c.is_control() || is_bidi_control(c);
    if !s.chars().any(needs) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(
        s.chars()
            .filter_map(|c| match c {
                '\n' | '\t' if keep_breaks => Some(c),
                // CRLF text keeps its line breaks without a stray mark.
                '\r' if keep_breaks => None,
                '\n' | '\r' | '\t' => Some(' '),
                c if needs(c) => Some('\u{FFFD}'),
                c => Some(c),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(t: &Table, width: Option<usize>) -> String {
        t.lines(width).join("\n")
    }

    #[test]
    fn columns_line_up_and_counts_align_right() {
        let mut t = Table::new(vec![
            Column::new("REASON"),
            Column::new("TYPE"),
            Column::new("COUNT").right(),
        ]);
        t.push(["exhausted", "send_email", "3"]);
        t.push(["crash_loop", "resize", "1204"]);
        assert_eq!(
            render(&t, None),
            "REASON      TYPE        COUNT\n\
             exhausted   send_email      3\n\
             crash_loop  resize       1204"
        );
    }

    #[test]
    fn no_trailing_spaces_and_missing_cells_are_empty() {
        let mut t = Table::new(vec![Column::new("A"), Column::new("LONG_HEADER")]);
        t.push(["x"]);
        let lines = t.lines(None);
        assert_eq!(lines, ["A  LONG_HEADER", "x"]);
    }

    #[test]
    fn a_long_cell_is_cut_to_its_column_max() {
        let mut t = Table::new(vec![Column::new("ID"), Column::new("ERROR").width_max(10)]);
        t.push(["a", "timeout: upstream took too long"]);
        assert_eq!(render(&t, None), "ID  ERROR\na   timeout:…");
    }

    #[test]
    fn a_flexible_column_shrinks_to_fit_the_total_width() {
        let mut t = Table::new(vec![Column::new("ID"), Column::new("ERROR").flex()]);
        let message = "parse: expected value at line 1 column 17 of the payload";
        t.push(["job-1", message]);
        let lines = t.lines(Some(30));
        assert!(lines.iter().all(|l| display_width(l) <= 30), "{lines:?}");
        assert_eq!(lines[1], "job-1  parse: expected value…");
        // Without a limit nothing is cut.
        assert!(t.lines(None)[1].ends_with("payload"));
    }

    #[test]
    fn a_flexible_column_keeps_a_floor() {
        let mut t = Table::new(vec![Column::new("ID"), Column::new("ERROR").flex()]);
        t.push(["x".repeat(40), "y".repeat(40)]);
        let lines = t.lines(Some(20));
        assert_eq!(display_width(&lines[1]), 40 + GAP + FLEX_WIDTH_MIN);
    }

    #[test]
    fn cutting_is_unicode_safe_and_counts_display_columns() {
        assert_eq!(cut("héllo wörld", 6), "héllo…");
        // Wide characters take two columns; a half does not fit.
        assert_eq!(cut("日本語のテキスト", 6), "日本…");
        assert_eq!(display_width(&cut("日本語のテキスト", 6)), 5);
        // A combining mark stays with its base character.
        assert_eq!(cut("e\u{301}e\u{301}e\u{301}", 2), "e\u{301}…");
        assert_eq!(cut("🦀🦀🦀", 4), "🦀…");
        assert_eq!(cut("short", 5), "short");
        assert_eq!(cut("anything", 0), "");
        assert_eq!(cut("ab", 1), "…");
    }

    #[test]
    fn wide_cells_still_line_up() {
        let mut t = Table::new(vec![Column::new("TENANT"), Column::new("N").right()]);
        t.push(["日本", "1"]);
        t.push(["acme", "22"]);
        assert_eq!(render(&t, None), "TENANT   N\n日本     1\nacme    22");
    }

    #[test]
    fn control_and_bidi_characters_cannot_reach_the_terminal() {
        assert_eq!(clean_line("a\nb\tc"), "a b c");
        assert_eq!(clean_line("\u{1b}[31mred"), "\u{FFFD}[31mred");
        assert_eq!(clean_line("abc\u{202E}fed"), "abc\u{FFFD}fed");
        assert_eq!(
            clean_text("line 1\r\n\tline 2\u{7}"),
            "line 1\n\tline 2\u{FFFD}"
        );
        assert!(matches!(clean_line("plain"), Cow::Borrowed(_)));

        let mut t = Table::new(vec![Column::new("MESSAGE")]);
        t.push(["first\nsecond"]);
        assert_eq!(t.lines(None)[1], "first second");
    }
}
