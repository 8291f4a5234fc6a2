//! How far the agent's `follow_lead` can take it on a collection, measured
//! before any training (`tool-gateway leads`).
//!
//! For each judged question the opening search runs as the agent's does (the
//! same tool, [`SEARCH_HITS`] hits shown, the observation cap) and its leads
//! are listed exactly as the agent's observation lists them
//! ([`sleuth_chat::bridge::leads`]). Each lead is then followed in turn (a
//! BM25 search of the lead, as `follow_lead` runs it) until one shows a
//! judged document not shown yet; from that lead's results the next hop
//! starts. No policy can choose a lead that is not listed, so the report
//! bounds what multi-hop search can add on this collection: per hop, which
//! lead number reaches the next judged document, and the judged documents
//! shown by the opening search alone against those shown by following the
//! best leads.

use std::collections::{BTreeMap, HashSet};

use sleuth_chat::bridge::{WordStats, leads};
use sleuth_chat::observation::{LEADS, SEARCH_HITS, parse_search_results, shows};

use crate::collection::Collection;
use crate::error::Error;
use crate::tools::{self, Observation, ToolCall};

/// A judged question: its text and the documents judged relevant to it.
pub struct Question<'a> {
    pub text: &'a str,
    pub judged: HashSet<&'a str>,
}

/// What following leads reached over a split's questions.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Reach {
    /// Questions measured (those with a document judged relevant).
    pub questions: usize,
    /// Per hop (the first is hop 1): what its leads reached.
    pub hops: Vec<HopReach>,
    /// Judged documents the opening search shows, as a share of each
    /// question's judged documents, averaged over questions.
    pub opening_recall: f64,
    /// The same after following the reaching lead at every hop.
    pub led_recall: f64,
}

/// One hop over the questions still missing a judged document there.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct HopReach {
    /// Questions that still missed a judged document at this hop.
    pub questions: usize,
    /// How many of them the lead numbered `i + 1` reached first.
    pub by_lead: [usize; LEADS],
    /// How many no listed lead reached (or listed no lead).
    pub none: usize,
}

/// Follows the leads of `questions` for up to `hops` hops after the opening
/// search `opening` (the question's search, given its text) on `collection`,
/// with observations capped at `char_cap` characters as the agent's are.
pub fn reach(
    collection: &Collection,
    questions: &[Question<'_>],
    opening: impl Fn(usize, &str) -> Result<Observation, Error>,
    hops: usize,
    char_cap: usize,
) -> Result<Reach, Error> {
    let follow = |lead: &str| {
        let call = ToolCall::Bm25Search { query: lead.to_owned(), k: SEARCH_HITS };
        tools::execute(collection, &call, None, char_cap, 0)
    };
    let mut out = Reach { hops: vec![HopReach::default(); hops], ..Reach::default() };
    for (index, question) in questions.iter().enumerate() {
        // A question judged with no relevant document has nothing to reach.
        if question.judged.is_empty() {
            continue;
        }
        out.questions += 1;
        let mut shown: HashSet<String> = HashSet::new();
        let mut observation = opening(index, question.text)?;
        shown.extend(shown_ids(collection, &observation));
        let share = |shown: &HashSet<String>| {
            question.judged.iter().filter(|id| shown.contains(**id)).count() as f64 / question.judged.len() as f64
        };
        out.opening_recall += share(&shown);
        // What no lead repeats: the question and every query searched.
        let mut known = vec![question.text.to_owned()];
        for hop in out.hops.iter_mut() {
            if question.judged.iter().all(|id| shown.contains(*id)) {
                break;
            }
            hop.questions += 1;
            let stats = WordStats { df: collection.word_df(&observation.text)?, documents: collection.len() as u32 };
            let listed = leads(&parse_search_results(&observation.text), &known, &stats);
            let mut reached = None;
            for (number, lead) in listed.iter().enumerate() {
                let followed = follow(lead)?;
                let ids = shown_ids(collection, &followed);
                if ids.iter().any(|id| question.judged.contains(id.as_str()) && !shown.contains(id)) {
                    reached = Some((number, lead.clone(), followed, ids));
                    break;
                }
            }
            let Some((number, lead, followed, ids)) = reached else {
                hop.none += 1;
                break;
            };
            hop.by_lead[number] += 1;
            shown.extend(ids);
            known.push(lead);
            observation = followed;
        }
        out.led_recall += share(&shown);
    }
    if out.questions > 0 {
        out.opening_recall /= out.questions as f64;
        out.led_recall /= out.questions as f64;
    }
    Ok(out)
}

/// The ids of the hits `observation` shows (as the agent counts them: a hit
/// the character cap cut off was never shown).
fn shown_ids(collection: &Collection, observation: &Observation) -> Vec<String> {
    observation.hits[..observation.shown]
        .iter()
        .map(|hit| collection.document(hit.ordinal).id.clone())
        .filter(|id| shows(&observation.text, observation.truncated, id))
        .collect()
}

impl Reach {
    /// The report: the recall of the opening search and of the best leads,
    /// then one line per hop with the share each lead number reached.
    pub fn render(&self) -> String {
        let percent = |n: usize, of: usize| if of == 0 { 0.0 } else { 100.0 * n as f64 / of as f64 };
        let mut lines = vec![format!(
            "judged documents shown: opening search {:.1} %, following the best listed lead at each hop {:.1} % \
             ({} questions)",
            100.0 * self.opening_recall,
            100.0 * self.led_recall,
            self.questions
        )];
        let heading: Vec<String> = (1..=LEADS).map(|n| format!("{:>7}", format!("lead {n}"))).collect();
        lines.push(format!("hop  questions {}    none", heading.join("")));
        for (hop, tally) in self.hops.iter().enumerate().take_while(|(_, tally)| tally.questions > 0) {
            let by_lead: String =
                tally.by_lead.iter().map(|&n| format!("{:>6.1}%", percent(n, tally.questions))).collect();
            lines.push(format!(
                "{:>3}  {:>9} {by_lead} {:>6.1}%",
                hop + 1,
                tally.questions,
                percent(tally.none, tally.questions)
            ));
        }
        lines.join("\n")
    }
}

/// Each judged question of `qrels` that `texts` has (id to text): its text
/// and its documents judged relevant (grade above 0), in id order.
pub fn judged_questions<'a>(
    texts: &'a BTreeMap<String, String>,
    qrels: &'a sleuth_beir::Qrels,
) -> Vec<(&'a str, Question<'a>)> {
    qrels
        .iter()
        .filter_map(|(id, grades)| {
            let text = texts.get(id)?;
            let judged = grades.iter().filter(|(_, grade)| **grade > 0).map(|(doc, _)| doc.as_str()).collect();
            Some((id.as_str(), Question { text, judged }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use sleuth_beir::{BadLines, BeirDir};

    use super::*;
    use crate::bm25::Bm25Options;
    use crate::index;

    /// A company whose founder's own page only the founder's name finds,
    /// other companies and people around it, and a judged page no search
    /// of the question or of a lead reaches.
    fn collection() -> (tempfile::TempDir, Collection) {
        let documents = [
            ("fanil", "Fanil Foundry", "Fanil Foundry was started by Masai Kibraizou in 1916. It makes oak barrels."),
            ("masai", "Masai Kibraizou", "Masai Kibraizou grew up in Drepour and still lives there."),
            ("nefas", "Nefas Foundry", "Nefas Foundry was started by Bouga Naiklak in 1892. It makes clay tiles."),
            ("bouga", "Bouga Naiklak", "Bouga Naiklak grew up in Ostrel."),
            ("desan", "Desan Works", "Desan Works was started by Fodail Bresai in 1850. It makes glass beads."),
            ("fodail", "Fodail Bresai", "Fodail Bresai grew up in Lumeth."),
            ("marsh", "Marsh birds", "Quiet marsh birds sing at dawn over the reeds."),
        ];
        let dir = tempfile::tempdir().unwrap();
        let corpus: String = documents
            .iter()
            .map(|(id, title, text)| serde_json::json!({"_id": id, "title": title, "text": text}).to_string() + "\n")
            .collect();
        std::fs::write(dir.path().join("corpus.jsonl"), corpus).unwrap();
        let out = dir.path().join("index");
        index::build(
            &BeirDir::new(dir.path()),
            &out,
            "reach",
            &Bm25Options::default(),
            BadLines::Fail,
            None,
            &mut |_| {},
        )
        .unwrap();
        let collection = Collection::open(&out, out.display().to_string()).unwrap();
        (dir, collection)
    }

    #[test]
    fn a_lead_that_reaches_the_next_judged_document_is_counted_by_its_number_and_a_missing_one_as_none() {
        let (_dir, collection) = collection();
        let questions = [
            // Hop 1 needs the founder, whose name only the company's page gives.
            Question { text: "Which town is home to the founder of Fanil Foundry?", judged: ["fanil", "masai"].into() },
            // No lead of the tiles maker's page leads to the marsh page.
            Question { text: "Which foundry makes clay tiles?", judged: ["nefas", "marsh"].into() },
            // Judged, but nothing relevant (every grade 0): not measured.
            Question { text: "Who makes glass beads?", judged: HashSet::new() },
        ];
        let opening = |_: usize, text: &str| {
            let call = ToolCall::Bm25Search { query: text.to_owned(), k: SEARCH_HITS };
            tools::execute(&collection, &call, None, 2000, 0)
        };
        let reached = reach(&collection, &questions, opening, 3, 2000).unwrap();

        assert_eq!(reached.questions, 2);
        let first = &reached.hops[0];
        assert_eq!(first.questions, 2, "{reached:?}");
        assert_eq!(first.none, 1, "{reached:?}");
        assert_eq!(first.by_lead.iter().sum::<usize>(), 1, "{reached:?}");
        // Every judged document found after hop 1: no question goes on.
        assert_eq!(reached.hops[1].questions, 0, "{reached:?}");
        assert!((reached.opening_recall - 0.5).abs() < 1e-9, "{reached:?}");
        assert!((reached.led_recall - 0.75).abs() < 1e-9, "{reached:?}");
        let report = reached.render();
        assert!(
            report.contains("opening search 50.0 %, following the best listed lead at each hop 75.0 %"),
            "{report}"
        );
        assert!(report.lines().any(|line| line.starts_with("  1          2") && line.ends_with(" 50.0%")), "{report}");
    }
}
